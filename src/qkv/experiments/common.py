"""What every experiment shares: a seeded scope, the output folder, atomic JSON/PNG writes, the
device, and the fitted power law used by the scaling figures.

Every experiment writes ``<out>/<name>/results.json`` (schema ``qkv-experiment/1``, see
:func:`write_results`) and one or more PNG figures next to it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch

# qkv's one device picker and atomic writers; the experiments (and qkv explain/report) import them from here
from qkv.runtime.device import pick_device  # noqa: F401
from qkv.runtime.fileio import atomic_path, write_json, write_text  # noqa: F401
from qkv.runtime.machine import environment

if TYPE_CHECKING:  # matplotlib is imported only where a figure is drawn
    from matplotlib.figure import Figure

SCHEMA = "qkv-experiment/1"


@dataclass
class ExperimentResult:
    """What an experiment hands back: its numbers, its one-line claims and the files it wrote."""

    name: str  # experiment name, e.g. "softmax-scaling"
    quick: bool  # run in --quick mode (small sizes, for tests)
    seed: int  # the seed it ran under
    config: dict  # the sizes it ran with
    results: dict  # the measured numbers (JSON-able)
    claims: dict[str, bool]  # each claim of the issue -> whether these numbers support it
    summary: list[str]  # a few human-readable lines
    figures: list[str] = field(default_factory=list)  # PNG file names, relative to the folder
    seconds: float = 0.0  # wall time of the run
    folder: Path | None = None  # where results.json was written

    def to_dict(self) -> dict:
        """The result as a JSON-ready dict, with the schema version."""
        return {
            "schema": SCHEMA,
            "experiment": self.name,
            "quick": self.quick,
            "seed": self.seed,
            "config": self.config,
            "results": self.results,
            "claims": self.claims,
            "summary": self.summary,
            "figures": self.figures,
            "seconds": round(self.seconds, 3),
            "environment": environment(),
        }


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` and restore the caller's RNG state afterwards,
    so an experiment is reproducible without changing the global random state of its caller."""
    devices = [device.index or 0] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush subnormal floats to zero inside the block, then restore torch's default (off).

    Vanishing gradients underflow into subnormal numbers, which x86 CPUs process up to ~100 times
    slower: a tanh RNN trained on 512 steps spends most of its time on them. Values that small
    (below 1e-38 in float32) change nothing the experiments measure.
    """
    torch.set_flush_denormal(True)  # returns False where unsupported: then nothing changes
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def experiment_dir(out: str | Path, name: str) -> Path:
    """The folder ``out/name``, made if missing."""
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib Figure not registered with pyplot: no display, no global state, no leak."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 110) -> Path:
    """Save a matplotlib figure as PNG, atomically (see :mod:`qkv.runtime.fileio`)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return Path(path)


def write_results(result: ExperimentResult, folder: str | Path) -> Path:
    """Write ``results.json`` for ``result`` into ``folder`` and remember the folder."""
    folder = Path(folder)
    result.folder = folder
    return write_json(folder / "results.json", result.to_dict())


def fit_power_law(sizes: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``log value = exponent * log size + log coefficient``.

    Returns:
        ``(exponent, coefficient)``.
    """
    if len(sizes) != len(values) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, value) pairs, got {len(sizes)} sizes and {len(values)} values")
    if min(sizes) <= 0 or min(values) <= 0:
        raise ValueError(f"sizes and values must be positive for a log-log fit, got {list(sizes)}, {list(values)}")
    xs = [math.log(s) for s in sizes]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError(f"sizes must not all be equal, got {list(sizes)}")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, math.exp(my - slope * mx)


class Stopwatch:
    """``with Stopwatch() as w: ...; w.seconds``."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


@overload
def rounded(values: Mapping[str, object], digits: int = 6) -> dict[str, object]: ...
@overload
def rounded(values: float, digits: int = 6) -> float: ...
@overload
def rounded(values: object, digits: int = 6) -> object: ...


def rounded(values: object, digits: int = 6) -> object:
    """Floats (possibly nested in lists/dicts) rounded to ``digits`` significant digits for JSON."""
    if isinstance(values, Mapping):
        return {k: rounded(v, digits) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [rounded(v, digits) for v in values]
    if isinstance(values, float):
        if not math.isfinite(values):
            raise ValueError(f"cannot store a non-finite number in results: {values}")
        return float(f"{values:.{digits}g}")
    return values
