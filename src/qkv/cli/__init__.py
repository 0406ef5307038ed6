"""The ``qkv`` command line: one thin module per subcommand, imported only when it runs.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``. Seeds, thread
counts and logging are set here, in the CLI layer, never in the library.

Every error is one line on stderr: exit code 2 for bad input (a usage error, a missing or bad file,
a bad option value), 1 for a fault (anything else); ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

# name -> (module, one-line help). A module that does not exist yet is left out of the CLI.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("qkv.cli.demo", "train on the built-in date task, show accuracy, samples and attention"),
    "train": (
        "qkv.cli.train",
        "train a translation model (e.g. --data multi30k) or a language model (--data tinyshakespeare)",
    ),
    "recipes": ("qkv.cli.recipes", "list the recipes qkv train starts from, or show one as it would run here"),
    "prepare": (
        "qkv.cli.prepare",
        "tokenize a parallel corpus of any size once into a prepared folder (for qkv train --prepared)",
    ),
    "translate": ("qkv.cli.translate", "translate lines from stdin or a file with a trained run"),
    "generate": ("qkv.cli.generate", "continue a prompt with a trained language model (or GPT-2)"),
    "export": (
        "qkv.cli.export",
        "write a run as a Hugging Face folder (--to hf), ONNX (--to onnx) or CTranslate2 (--to ctranslate2)",
    ),
    "evaluate": (
        "qkv.cli.evaluate",
        "score a translation run (sacreBLEU, chrF, the papers' BLEU) or a language model (loss, perplexity, bits/char)",
    ),
    "embed": ("qkv.cli.embed", "sentence embeddings from a pretrained encoder"),
    "attend": ("qkv.cli.attend", "write a self-contained HTML attention explorer"),
    "serve": ("qkv.cli.serve", "serve translation, generation, embeddings and the attention explorer over HTTP"),
    "explain": ("qkv.cli.explain", "attention worked by hand, step by step"),
    "experiment": ("qkv.cli.experiment", "run one of the explanatory experiments"),
    "report": ("qkv.cli.report", "gather experiment results into one HTML page"),
    "bench": ("qkv.cli.bench", "time qkv against PyTorch and Hugging Face side by side"),
}


def available_commands() -> dict[str, tuple[str, str]]:
    """The registered subcommands whose module exists."""
    return {name: entry for name, entry in COMMANDS.items() if importlib.util.find_spec(entry[0]) is not None}


# errors that mean "the input or an option is wrong" (exit 2); anything else is a fault (exit 1)
INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``qkv train: error: ... (see qkv train --help)``, that
    keeps the arguments it parses (``given_args``: a subcommand's help action can read the options
    given after ``--help`` too, e.g. ``qkv train --help --data dates``)."""

    given_args: list[str] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.given_args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())  # messages from libraries can span lines
    return text[:500] or type(err).__name__


def build_parser(chosen: str | None, *, every: bool = False) -> argparse.ArgumentParser:
    """The ``qkv`` parser, with the options of subcommand ``chosen`` (of every one, with ``every``).

    A subcommand module whose ``OWN_HELP`` is true adds its own ``-h``/``--help`` (``qkv train``
    shows the options most runs need, with its recipe's defaults); the others get argparse's.
    """
    from qkv import __version__

    parser = _Parser(prog="qkv", description="Attention Is All You Need, built for real.")
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in available_commands().items():
        module = importlib.import_module(module_name) if every or name == chosen else None
        own_help = bool(getattr(module, "OWN_HELP", False))
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=not own_help)
        if module is not None:
            module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``qkv`` command line: parse ``argv``, set up logging and run the chosen subcommand,
    reporting any error in one line on stderr.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: the subcommand's own (0 on success; with no subcommand the help is printed
        and 0 returned), 2 for bad input, 1 for a fault or a closed output pipe, 130 when
        interrupted. A usage error exits 2 from argparse itself.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    from qkv.runtime.heap import limit_memory_growth

    # before the first oneDNN primitive: bf16 on AVX512-BF16/AMX CPUs compiles one per product shape
    # (qkv.runtime.heap.ONEDNN_CACHE_CAPACITY; a user's own ONEDNN_PRIMITIVE_CACHE_CAPACITY wins)
    limit_memory_growth()
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `qkv translate ... | head`: the reader left, nothing to report
        return 1
    except INPUT_ERRORS as err:
        if args.verbose:
            traceback.print_exc()
        message = _one_line(err)
        if isinstance(err, UnicodeError) and not message.startswith(("<", "/")):
            message = f"not valid UTF-8 text ({message})"
        print(f"qkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(f"qkv {args.command}: error: {type(err).__name__}: {_one_line(err)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
