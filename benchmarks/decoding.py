"""Greedy and beam-5 decoding of 64 tokens, with and without qkv's KV cache, against Hugging Face
generate on a MarianMT model of the same size (random weights, lengths forced equal).

Writes benchmarks/results/decoding.json and decoding.png and prints the ratios; the same as
`qkv bench decoding`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data).

    python benchmarks/decoding.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

SHARED_MULTI30K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "multi30k"

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--data" not in args and SHARED_MULTI30K.is_dir():
        args += ["--data", str(SHARED_MULTI30K)]
    sys.exit(main(["bench", "decoding", *args]))
