"""Training-step throughput (target tokens/s) on real Multi30k batches: qkv's Transformer against
torch.nn.Transformer and a randomly initialised Hugging Face MarianMT of the same size, fp32 and
bf16 autocast, same batches, same loss and optimiser.

Writes benchmarks/results/performance/training.json and training.png and prints the ratios; the same as
`qkv bench training`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data);
without --out it writes into benchmarks/results/performance/.

    python benchmarks/training_step.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

OUT = Path(__file__).resolve().parent / "results" / "performance"

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    # `qkv bench SUITE --out OUT ARGS`: an --out among ARGS comes later and wins
    sys.exit(main(["bench", "training", "--out", str(OUT), *sys.argv[1:]]))
