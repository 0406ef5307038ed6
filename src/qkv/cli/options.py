"""Option helpers shared by the subcommands: checked number types for argparse, the thread count
(set only here, in the CLI layer) and the options more than one subcommand declares."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from qkv.inference.ctranslate2 import COMPUTE_TYPES
from qkv.inference.decode import MAX_BEAM as MAX_BEAM  # the one beam limit, re-exported
from qkv.inference.decode import DecodeConfig

if TYPE_CHECKING:
    from qkv.decoding.search import PenaltyForm
    from qkv.inference.ctranslate2 import Ct2Translator

Number = TypeVar("Number", int, float)


def _number(
    kind: Callable[[str], Number], minimum: float, what: str, maximum: float | None = None
) -> Callable[[str], Number]:
    """An argparse type: ``kind(text)`` within ``[minimum, maximum]`` (finite), else a usage error
    that says ``what`` was expected."""

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, "an integer >= 1")
non_negative_int = _number(int, 0, "an integer >= 0")


def _declared(name: str, why: str = "") -> Callable[[str], Any]:
    """The argparse type of :class:`~qkv.inference.decode.DecodeConfig`'s field ``name``: its declared range."""
    meta = DecodeConfig.option(name).metadata
    low, high = meta["minimum"], meta["maximum"]
    kind = "an integer" if meta["integer"] else "a number"
    span = f"from {low:g} to {high:g}" if high is not None else f">= {low:g}"
    return _number(int if meta["integer"] else float, low, f"{kind} {span}{why}", maximum=high)


length_penalty = _declared("alpha")

# Counts that size memory allocated up front: a huge value is refused here, in one line, rather
# than ending in MemoryError (a length that is streamed, e.g. --max-new-tokens, is not bounded)
MAX_SAMPLES = 100
num_samples = _number(
    int,
    1,
    f"an integer from 1 to {MAX_SAMPLES} (the samples are generated together as one "
    "batch, so memory grows with their number)",
    maximum=MAX_SAMPLES,
)
# MAX_BEAM (qkv.inference.decode, re-exported here): the one beam limit, DecodeConfig's declared maximum
beam_size = _declared(
    "beam_size", " (beam search decodes that many copies of each sentence at once, so memory grows with it)"
)
max_batch_tokens = _declared("max_batch_tokens")


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads (None: torch's default, all cores). Raises ``ValueError`` below 1."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)


def add_ensemble_option(parser: argparse.ArgumentParser) -> None:
    """``--ensemble RUN [RUN ...]`` for the subcommands that decode (translate, evaluate)."""
    parser.add_argument(
        "--ensemble",
        nargs="+",
        metavar="RUN",
        default=[],
        help="decode with these translation runs too, averaging every run's next-token "
        "probabilities (an ensemble; they must share the first run's tokenizer: trained "
        "on the same data). The first run's recipe gives the default beam and alpha",
    )


ENGINES = ("qkv", "ctranslate2")  # the engines --engine offers (qkv.inference.policy.ENGINES: what each can do)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """``--engine``, ``--quantization`` and ``--length-penalty-form`` for translate and evaluate."""
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="qkv",
        help="what decodes: qkv (default) or ctranslate2 (the run converted into a temporary folder, "
        "never into the run; or RUN_DIR may be a folder made by qkv export --to ctranslate2)",
    )
    parser.add_argument(
        "--quantization",
        choices=COMPUTE_TYPES,
        default=None,
        help="--engine ctranslate2 only: CTranslate2's compute type (default: the folder's stored type, "
        "float32 for a run; int8 is smaller and faster, its translations may differ)",
    )
    parser.add_argument(
        "--length-penalty-form",
        choices=DecodeConfig.option("penalty").metadata["choices"],
        default=None,
        help="how beam search divides a finished hypothesis's log-probability: gnmt, ((5 + len) / 6) ** alpha "
        "(qkv's default), or power, len ** alpha (the form of CTranslate2 and Hugging Face generate; the only "
        "one CTranslate2 has, so its default there); len counts EOS. Default: the run's saved form (a run "
        "saved without one: gnmt), or the engine's own",
    )


def check_engine(args: argparse.Namespace) -> PenaltyForm:
    """The length-penalty form to decode with, once ``args``' engine options agree with the rest
    (:func:`qkv.inference.policy.check_engine`): ``ValueError`` (one line) for what the chosen engine
    cannot do."""
    from qkv.inference.policy import check_engine as check

    return check(
        args.engine,
        penalty=args.length_penalty_form,
        quantization=args.quantization,
        ensemble=bool(getattr(args, "ensemble", None)),
        bf16=bool(getattr(args, "bf16", False)),
        other_runs=[str(path) for path in getattr(args, "against", []) if Path(path).is_dir()],
    )


def decode_config(args: argparse.Namespace, config: dict) -> DecodeConfig:
    """How ``qkv translate`` / ``qkv evaluate`` decode: ``--beam``, ``--alpha`` and
    ``--length-penalty-form`` over the run's (or export's) saved ``decode``; with another engine than
    qkv, the form is the flag's or that engine's own (a saved form is qkv's).

    Args:
        args: the parsed command line (``engine``, ``beam``, ``alpha``, ``length_penalty_form``).
        config: the run's config.json, or ``{"decode": manifest["decode"]}`` of an export.

    Returns:
        The checked settings.
    """
    from qkv.inference.policy import check_engine as check

    flag = args.length_penalty_form
    decode = DecodeConfig.of_run(config, beam_size=args.beam, alpha=args.alpha, penalty=flag)
    if args.engine != "qkv":
        decode = replace(decode, penalty=check(args.engine, penalty=flag))
    return decode


def ct2_translator(args: argparse.Namespace, device: torch.device) -> AbstractContextManager[Ct2Translator]:
    """A CTranslate2 translator for ``args.run_dir`` (an export, or a run converted into a temporary
    folder that is removed on leaving; the run is only read), with ``--weights``, ``--threads`` (CTranslate2's
    intra_threads; default: its own) and ``--quantization`` (the compute type)."""
    try:
        from qkv.export.ctranslate2 import open_translator
        from qkv.inference.ctranslate2 import ct2_device

        where = ct2_device(device.type, args.device)
    except ImportError as err:
        raise ValueError(f"--engine ctranslate2 needs ctranslate2: pip install 'qkv[deploy]' ({err})") from None
    return open_translator(
        args.run_dir,
        weights=args.weights,
        device=where,
        threads=args.threads or 0,
        compute_type=args.quantization or "default",
    )
