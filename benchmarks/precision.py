"""The training step of qkv's Multi30k model in fp32, under bf16 autocast and with torch.compile:
the speed-ups, timed interleaved. (BLEU of a short bf16 run against fp32: precision_bleu.py.)

Writes benchmarks/results/precision.json and precision.png and prints the ratios; the same as
`qkv bench precision`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data).

    python benchmarks/precision.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

SHARED_MULTI30K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "multi30k"

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--data" not in args and SHARED_MULTI30K.is_dir():
        args += ["--data", str(SHARED_MULTI30K)]
    sys.exit(main(["bench", "precision", *args]))
