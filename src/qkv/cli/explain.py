"""``qkv explain``: scaled dot-product and multi-head attention worked by hand, step by step.

qkv explain                       # 4 tokens, 6 features, d_k = 3, 2 heads
qkv explain --format markdown -o attention-by-hand.md
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv explain``'s flags: the example's sizes (``--tokens``, ``--dim``, ``--dk``,
    ``--heads``), ``--seed``, ``--format``, ``--decimals`` and ``-o/--output``.

    Args:
        parser: the ``explain`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights (default 0)")
    parser.add_argument("--tokens", type=int, default=4, help="number of tokens n (default 4)")
    parser.add_argument("--dim", type=int, default=6, help="features per token d (default 6)")
    parser.add_argument("--dk", type=int, default=3, help="query/key/value size of the single head (default 3)")
    parser.add_argument(
        "--heads", type=int, default=2, help="heads of the multi-head part; must divide --dim (default 2)"
    )
    parser.add_argument("--format", choices=("text", "markdown"), default="text", help="output format (default text)")
    parser.add_argument("--decimals", type=int, default=3, help="decimals printed (default 3)")
    parser.add_argument("-o", "--output", help="write to this file instead of standard output")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv explain``: work attention by hand on random inputs and print each step (as text or
    markdown) to stdout or ``--output``, checking the by-hand numbers against the library's.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 when the by-hand and library results agree (within 1e-6), 1 when they
        differ (a bug, reported on stderr). A ``--decimals`` outside 0..12 raises ``ValueError``,
        which the CLI reports as exit code 2.
    """
    from qkv.experiments.common import write_text
    from qkv.experiments.explain import format_example, worked_example

    if not 0 <= args.decimals <= 12:
        raise ValueError(f"--decimals must be between 0 and 12, got {args.decimals}")
    example = worked_example(tokens=args.tokens, dim=args.dim, dk=args.dk, heads=args.heads, seed=args.seed)
    text = format_example(example, fmt=args.format, decimals=args.decimals)
    if args.output:
        print(f"wrote {write_text(args.output, text)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    worst = max(example.checks.values())
    if worst > 1e-6:  # the by-hand numbers and the library disagree: a bug, say so loudly
        print(f"qkv explain: by-hand and library results differ by {worst:.1e}", file=sys.stderr)
        return 1
    return 0
