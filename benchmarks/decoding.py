"""Greedy and beam-5 decoding of 64 tokens, with and without qkv's KV cache, against Hugging Face
generate on a MarianMT model of the same size (random weights, lengths forced equal).

Writes benchmarks/results/decoding.json and decoding.png and prints the ratios; the same as
`qkv bench decoding`. Arguments are those of `qkv bench` (--quick, --threads, --device, --out, --data).

    python benchmarks/decoding.py --threads 2
"""

import sys

from qkv.cli import main

if __name__ == "__main__":  # --data defaults to qkv's lookup: $QKV_DATA/multi30k, then the cache
    sys.exit(main(["bench", "decoding", *sys.argv[1:]]))
