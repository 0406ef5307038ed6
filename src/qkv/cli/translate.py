"""``qkv translate``: translate lines with a trained run folder.

    echo "A man rides a bike." | qkv translate runs/en-de --beam 5
    qkv translate runs/en-de sentences.en -o sentences.de
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder made by qkv train")
    parser.add_argument("input", nargs="?", help="file with one sentence a line (.gz allowed; default: stdin)")
    parser.add_argument("-o", "--output", help="write the translations here (default: stdout)")
    parser.add_argument("--beam", type=int, default=5, help="beam size (1 = greedy; default 5)")
    parser.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent (default 0.6)")
    parser.add_argument("--weights", choices=["model", "best", "last"], default="model",
                        help="model = averaged final weights (default), best = best validation BLEU, last")
    parser.add_argument("--bf16", action="store_true", help="decode under bfloat16 autocast")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    from qkv.checkpoint import atomic_path, load_run
    from qkv.data.parallel import read_lines
    from qkv.evaluation import translate_texts

    if args.beam < 1:
        raise ValueError(f"--beam must be >= 1, got {args.beam}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_run(args.run_dir, args.weights)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.input:
        lines = read_lines(args.input)
    else:
        data = sys.stdin.buffer.read()
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            raise ValueError(f"<stdin>, line {line}: not valid UTF-8 ({err.reason} at byte {err.start})") from err
    outputs = translate_texts(model, tokenizer, lines, beam_size=args.beam, alpha=args.alpha, bf16=args.bf16,
                              progress=len(lines) > 100 and sys.stderr.isatty())
    text = "".join(line + "\n" for line in outputs)
    if args.output:
        with atomic_path(Path(args.output).resolve()) as tmp:
            tmp.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0
