"""The attention op (qkv eager reference, qkv fast path, torch SDPA) and the attention module (qkv
MultiHeadAttention, torch.nn.MultiheadAttention, with and without need_weights), s in {128, 512,
2048, 8192}, fp32 and bf16, causal and not, forward and forward+backward; times and peak memory.

Writes benchmarks/results/performance/attention.json and attention.png and prints the ratios; the same as
`qkv bench attention`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data);
without --out it writes into benchmarks/results/performance/.

    python benchmarks/attention.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

OUT = Path(__file__).resolve().parent / "results" / "performance"

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    # `qkv bench SUITE --out OUT ARGS`: an --out among ARGS comes later and wins
    sys.exit(main(["bench", "attention", "--out", str(OUT), *sys.argv[1:]]))
