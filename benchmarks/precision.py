"""The training step of qkv's Multi30k model in fp32, under bf16 autocast and with torch.compile:
the speed-ups, timed interleaved. (BLEU of a short bf16 run against fp32: precision_bleu.py.)

Writes benchmarks/results/precision.json and precision.png and prints the ratios; the same as
`qkv bench precision`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data).

    python benchmarks/precision.py --threads 2
"""

import sys

from qkv.cli import main

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    sys.exit(main(["bench", "precision", *sys.argv[1:]]))
