"""The training step of qkv's Multi30k model in fp32, under bf16 autocast and with torch.compile:
the speed-ups, timed interleaved. (BLEU of a short bf16 run against fp32: studies/precision_bleu.py.)

Writes benchmarks/results/performance/precision.json and precision.png and prints the ratios; the same as
`qkv bench precision`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data);
without --out it writes into benchmarks/results/performance/.

    python benchmarks/precision.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

OUT = Path(__file__).resolve().parent / "results" / "performance"

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    # `qkv bench SUITE --out OUT ARGS`: an --out among ARGS comes later and wins
    sys.exit(main(["bench", "precision", "--out", str(OUT), *sys.argv[1:]]))
