"""``qkv report``: every experiment's results and figures in one self-contained HTML page.

qkv experiment all --quick && qkv report      # -> qkv-out/experiments/report.html
"""

from __future__ import annotations

import argparse

from qkv.cli.experiment import DEFAULT_OUT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv report``'s flags: ``--out`` (the experiments' folder), ``-o/--output`` and
    ``--title``.

    Args:
        parser: the ``report`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder holding the experiments' results (default {DEFAULT_OUT})"
    )
    parser.add_argument("-o", "--output", help="HTML file to write (default <out>/report.html)")
    parser.add_argument("--title", default="qkv experiments", help="page title")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv report``: gather every ``results.json`` and figure under ``--out`` into one
    self-contained HTML page and write it.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the page is written. A folder with no results or figures raises
        ``FileNotFoundError``, which the CLI reports as exit code 2.
    """
    from qkv.experiments.report import write_report

    path = write_report(args.out, args.output, title=args.title)
    print(f"wrote {path}")
    return 0
