"""Training-step throughput (target tokens/s) on real Multi30k batches: qkv's Transformer against
torch.nn.Transformer and a randomly initialised Hugging Face MarianMT of the same size, fp32 and
bf16 autocast, same batches, same loss and optimiser.

Writes benchmarks/results/training.json and training.png and prints the ratios; the same as
`qkv bench training`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data).

    python benchmarks/training_step.py --threads 2
"""

import sys
from pathlib import Path

from qkv.cli import main

SHARED_MULTI30K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "multi30k"

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--data" not in args and SHARED_MULTI30K.is_dir():
        args += ["--data", str(SHARED_MULTI30K)]
    sys.exit(main(["bench", "training", *args]))
