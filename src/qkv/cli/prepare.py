"""``qkv prepare``: tokenize a parallel corpus once into a prepared folder, for ``qkv train --prepared``.

    qkv prepare --train-src train.en --train-tgt train.de --val-src dev.en --val-tgt dev.de \\
                --vocab-size 37000 --out wmt14/prepared
    qkv prepare --train-src more.en.gz --train-tgt more.de.gz --tokenizer wmt14/prepared/tokenizer.json --out more

Streams any size (``.gz`` too) on several processes; bad lines (empty, not UTF-8, too long) are
left out, counted and listed by file:line; misaligned files are refused. The folder appears when
whole, or not at all.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qkv.cli.options import non_negative_int, positive_int
from qkv.runs.recipes import RECIPES

DEFAULT_VOCAB = RECIPES["files"]["vocab_size"]
DEFAULT_MAX_LEN = RECIPES["files"]["model"]["max_len"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv prepare``'s flags: the training and validation files, ``--out``, the tokenizer
    (``--vocab-size`` to learn one, ``--tokenizer`` to reuse one, ``--tokenizer-sample``),
    ``--max-len``, ``--workers``, ``--overwrite`` and ``--no-progress``.

    Args:
        parser: the ``prepare`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("--train-src", required=True, help="training source file, one sentence a line (.gz allowed)")
    parser.add_argument("--train-tgt", required=True, help="training target file, line-aligned with --train-src")
    parser.add_argument("--val-src", help="validation source file (optional)")
    parser.add_argument("--val-tgt", help="validation target file")
    parser.add_argument("--out", required=True, help="the prepared folder to create")
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help=f"shared BPE vocabulary to learn (default {DEFAULT_VOCAB}; the paper: 37000)",
    )
    parser.add_argument(
        "--tokenizer", help="use this tokenizer.json (e.g. another prepared folder's) instead of learning one"
    )
    parser.add_argument(
        "--tokenizer-sample",
        type=non_negative_int,
        default=1_000_000,
        help="learn the tokenizer on at most this many pairs, spread evenly over the corpus (0: all; "
        "default 1,000,000)",
    )
    parser.add_argument(
        "--max-len",
        type=positive_int,
        default=DEFAULT_MAX_LEN,
        help=f"longest sentence kept, in tokens with BOS/EOS: the model's --max-len (default "
        f"{DEFAULT_MAX_LEN}); longer pairs are left out and counted",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=None, help="processes that tokenize (default: one per CPU core)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out if it is a prepared folder holding only the files its manifest lists",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv prepare``: tokenize the corpus on several processes into the prepared folder
    ``--out`` and print, on stderr, how many pairs each split kept and left out.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the folder is written (bad lines left out do not change it).
        ``--vocab-size`` with ``--tokenizer``, a bad vocabulary size or misaligned files raise,
        which the CLI reports as exit code 2.
    """
    import time

    from qkv.data.preparing import REASONS, prepare_corpus
    from qkv.data.tokenizer import check_vocab_size

    if args.tokenizer and args.vocab_size is not None:
        raise ValueError("--vocab-size is for learning a tokenizer; --tokenizer brings its own vocabulary")
    if args.vocab_size is not None:  # before the corpus is read, not after
        check_vocab_size(args.vocab_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = args.workers or cores or 1
    start = time.perf_counter()
    manifest = prepare_corpus(
        args.train_src,
        args.train_tgt,
        args.out,
        val_src=args.val_src,
        val_tgt=args.val_tgt,
        vocab_size=args.vocab_size or DEFAULT_VOCAB,
        tokenizer=args.tokenizer,
        tokenizer_sample=args.tokenizer_sample,
        max_len=args.max_len,
        workers=workers,
        overwrite=args.overwrite,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in Path(args.out).iterdir() if p.is_file())
    parts, any_bad = [], False
    for split, info in manifest["splits"].items():
        dropped = {k: n for k, n in manifest["dropped"][split].items() if n}
        any_bad = any_bad or bool(dropped)
        note = f" (left out: {', '.join(f'{n:,} {REASONS[k]}' for k, n in dropped.items())})" if dropped else ""
        parts.append(f"{info['pairs']:,} {split} pairs{note}")
    listed = f"; the first bad lines are listed in {Path(args.out) / 'manifest.json'}" if any_bad else ""
    print(
        f"prepared {' and '.join(parts)} into {args.out}: {size / 2**20:,.0f} MiB, a {manifest['vocab_size']:,}-token "
        f"vocabulary, {seconds:.0f} s ({manifest['lines']['train'] / seconds:,.0f} pairs/s){listed}",
        file=sys.stderr,
    )
    return 0
