"""Greedy and beam-5 decoding of 64 tokens, with and without qkv's KV cache, against Hugging Face
generate on a MarianMT model of the same size (random weights, lengths forced equal).

Writes benchmarks/results/performance/decoding.json and decoding.png and prints the ratios; the same as
`qkv bench decoding`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data);
without --out it writes into benchmarks/results/performance/.

    python benchmarks/decoding.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

OUT = Path(__file__).resolve().parent / "results" / "performance"

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    # `qkv bench SUITE --out OUT ARGS`: an --out among ARGS comes later and wins
    sys.exit(main(["bench", "decoding", "--out", str(OUT), *sys.argv[1:]]))
