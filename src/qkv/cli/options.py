"""Option helpers shared by the subcommands: checked number types for argparse, the thread count
(set only here, in the CLI layer) and the options more than one subcommand declares."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

import torch

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
length_penalty = _number(float, 0.0, "a number from 0 to 10", maximum=10.0)

# Counts that size memory allocated up front: a huge value is refused here, in one line, rather
# than ending in MemoryError (a length that is streamed, e.g. --max-new-tokens, is not bounded)
MAX_SAMPLES = 100
MAX_BEAM = 100
num_samples = _number(
    int,
    1,
    f"an integer from 1 to {MAX_SAMPLES} (the samples are generated together as one "
    "batch, so memory grows with their number)",
    maximum=MAX_SAMPLES,
)
beam_size = _number(
    int,
    1,
    f"an integer from 1 to {MAX_BEAM} (beam search decodes that many copies of each "
    "sentence at once, so memory grows with it)",
    maximum=MAX_BEAM,
)


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
