"""Where a benchmark writes its result, declared and checked the same way by every script.

A result file under ``benchmarks/results/`` is a figure the README cites, and a rerun's default
output is that very file. So a benchmark never replaces an existing result unless it is told to
(``--overwrite``), the rule ``qkv train`` follows for run folders, and it checks this before any
work: a refusal after an hour of training would cost the hour.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qkv.runtime.fileio import check_output_file


def add_result_options(
    parser: argparse.ArgumentParser,
    default: str | Path | None = None,
    *,
    flag: str = "--out",
    required: bool = False,
    what: str = "the result JSON",
) -> None:
    """Declare ``flag`` (the output file, ``default`` unless ``required``) and ``--overwrite``."""
    shown = "" if default is None else f" (default {default})"
    parser.add_argument(
        flag,
        default=None if default is None else str(default),
        required=required,
        help=f"{what}{shown}; an existing file is kept unless --overwrite",
    )
    parser.add_argument("--overwrite", action="store_true", help=f"replace an existing {flag}")


def check_result_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, path: str | Path | None = None, *, flag: str = "--out"
) -> Path:
    """``path`` (default: the value of ``flag``) checked before any work: a file that can be written
    and, without ``--overwrite``, does not exist yet. A refusal ends the program with the parser's
    one-line error (exit status 2)."""
    if path is None:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
    try:
        return check_output_file(path, flag, overwrite=args.overwrite)
    except OSError as err:
        parser.error(str(err))
