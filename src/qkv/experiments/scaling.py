"""Cost of self-attention against a recurrent layer (section 4, Table 1 of the paper).

Self-attention computes every pair of positions: O(n^2 d) work (plus O(n d^2) for the four
projections), but all of it in one parallel step. A recurrent layer does O(n d^2) work, in ``n``
steps that must run one after another. This experiment times both layers on this machine over
``n`` (at a fixed ``d``) and over ``d`` (at a fixed ``n``), forward and forward+backward, fits
``time ~ c * size^p`` on log-log axes, and reports time per token.

Timings are medians over samples, taken round-robin over the sizes (sample 1 of every size, then
sample 2, ...) so that a burst of load from other processes spreads over all sizes instead of
bending one point of the curve. A sample of a fast call repeats it until it lasts
``min_sample_seconds`` and divides, which averages out the occasional slow call (allocator page
faults cost a few milliseconds every few calls on CPU).

On CPU the default clock is the process's CPU time (``time.process_time``), not the wall clock:
on a machine shared with other work the scheduler takes the core away at random moments, which
lands in wall-clock samples as noise several times larger than the effect being measured, but
not in the CPU time this process actually spent. (With several torch threads it is the sum over
threads: the work, not the latency.) On CUDA the clock is the wall clock, synchronised. Both
medians are recorded.

Shape legend: ``b`` batch (1), ``n`` sequence length, ``d`` model width.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from qkv.attention.multihead import MultiHeadAttention
from qkv.experiments.common import (
    ExperimentResult,
    Stopwatch,
    experiment_dir,
    fit_power_law,
    new_figure,
    pick_device,
    rounded,
    save_figure,
    seeded,
    write_results,
)

NAME = "scaling"
LAYERS = ("attention", "rnn")
MODES = ("forward", "backward")  # "backward" = forward + backward


@dataclass(frozen=True)
class ScalingConfig:
    """Sizes of the scaling experiment."""

    lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)  # n, swept at d = fixed_dim
    dims: tuple[int, ...] = (64, 128, 256, 512, 1024)  # d, swept at n = fixed_length
    fixed_dim: int = 64  # d while sweeping n
    fixed_length: int = 512  # n while sweeping d
    head_dim: int = 64  # attention heads = max(1, d // head_dim)
    large_length: int = 1024  # the exponent in n is also fitted on n >= this ("large n")
    repeats: int = 5  # timed samples per size (the median is kept), after one warm-up run
    min_sample_seconds: float = 0.02  # a sample repeats the call until it lasts about this long
    clock: str = "auto"  # "cpu" (process CPU time), "wall", or "auto": cpu on CPU, wall on CUDA
    backward: bool = True  # also time forward + backward

    def __post_init__(self) -> None:
        if not self.lengths or not self.dims or min(self.lengths) < 2 or min(self.dims) < 1:
            raise ValueError(f"lengths and dims must be non-empty and positive, got {self.lengths}, {self.dims}")
        if len([n for n in self.lengths if n >= self.large_length]) < 2:
            raise ValueError(
                f"need at least two lengths >= large_length={self.large_length} to fit the large-n exponent, "
                f"got {self.lengths}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be positive, got {self.repeats}")
        if self.clock not in ("auto", "cpu", "wall"):
            raise ValueError(f"clock must be auto, cpu or wall, got {self.clock!r}")


# n from 1024 to 4096 with a small d: the n^2 d term dominates the n d^2 projections by far.
QUICK = ScalingConfig(
    lengths=(256, 1024, 2048, 4096),
    dims=(32, 64, 128),
    fixed_dim=32,
    fixed_length=256,
    repeats=3,
    min_sample_seconds=0.01,
)


def build_layer(kind: str, d: int, head_dim: int, device: torch.device) -> nn.Module:
    """qkv's :class:`MultiHeadAttention` (``max(1, d // head_dim)`` heads) or a tanh ``nn.RNN(d, d)``."""
    if kind == "attention":
        heads = max(1, d // head_dim)
        while d % heads:
            heads -= 1
        return MultiHeadAttention(d, heads).to(device)
    if kind == "rnn":
        return nn.RNN(d, d, batch_first=True).to(device)
    raise ValueError(f"unknown layer {kind!r}; choose attention or rnn")


def _step(kind: str, layer: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], None]:
    def forward() -> torch.Tensor:
        return layer(x).output if kind == "attention" else layer(x)[0]

    if mode == "forward":

        def run() -> None:
            with torch.no_grad():
                forward()
    else:

        def run() -> None:
            forward().sum().backward()
            layer.zero_grad(set_to_none=True)

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_clock(config: ScalingConfig, device: torch.device) -> str:
    """The clock to time with: the configured one, or for ``auto`` wall time on CUDA and CPU time otherwise."""
    if config.clock != "auto":
        return config.clock
    return "wall" if device.type == "cuda" else "cpu"


def time_layers(
    sizes: list[tuple[int, int]], config: ScalingConfig, device: torch.device, *, progress: bool = True, desc: str = ""
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Median seconds of each layer and mode at each ``(n, d)``, timed round-robin, by both clocks.

    Returns:
        ``{"cpu" | "wall": {layer: {mode: [seconds per size]}}}``.
    """
    modes = MODES if config.backward else MODES[:1]
    jobs = []
    for kind in LAYERS:
        for size_index, (n, d) in enumerate(sizes):
            layer = build_layer(kind, d, config.head_dim, device)
            x = torch.randn(1, n, d, device=device)  # (b, n, d)
            for mode in modes:
                jobs.append((kind, mode, size_index, _step(kind, layer, x, mode)))
    samples: dict[tuple[str, str, str], list[list[float]]] = {}
    calls = [1] * len(jobs)  # calls per sample, set from the warm-up
    bar = tqdm(total=len(jobs) * (config.repeats + 1), desc=desc or NAME, unit="run", disable=not progress)
    for repeat in range(config.repeats + 1):  # repeat 0 is the warm-up
        for j, (kind, mode, size_index, step) in enumerate(jobs):
            _sync(device)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls[j]):
                step()
            _sync(device)
            wall = (time.perf_counter() - start_wall) / calls[j]
            cpu = (time.process_time() - start_cpu) / calls[j]
            if repeat == 0:
                calls[j] = max(1, min(1000, round(config.min_sample_seconds / max(wall, 1e-7))))
            else:
                for clock, elapsed in (("wall", wall), ("cpu", cpu)):
                    samples.setdefault((clock, kind, mode), [[] for _ in sizes])[size_index].append(elapsed)
            bar.update()
    bar.close()
    return {
        clock: {
            kind: {mode: [statistics.median(s) for s in samples[(clock, kind, mode)]] for mode in modes}
            for kind in LAYERS
        }
        for clock in ("cpu", "wall")
    }


def _fits(sizes: list[int], timings: dict, minimum: int | None = None) -> dict:
    chosen = [i for i, s in enumerate(sizes) if minimum is None or s >= minimum]
    return {
        kind: {
            mode: fit_power_law([sizes[i] for i in chosen], [times[i] for i in chosen])[0]
            for mode, times in modes.items()
        }
        for kind, modes in timings.items()
    }


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: ScalingConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Time both layers over n and over d, fit exponents; write ``results.json`` and
    ``scaling.png`` under ``<out>/scaling``."""
    config = config or (QUICK if quick else ScalingConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    lengths, dims = list(config.lengths), list(config.dims)
    clock = resolve_clock(config, dev)
    with Stopwatch() as watch, seeded(seed, dev):
        both_by_length = time_layers(
            [(n, config.fixed_dim) for n in lengths], config, dev, progress=progress, desc=f"{NAME} over n"
        )
        both_by_dim = time_layers(
            [(config.fixed_length, d) for d in dims], config, dev, progress=progress, desc=f"{NAME} over d"
        )
    by_length, by_dim = both_by_length[clock], both_by_dim[clock]
    other = "wall" if clock == "cpu" else "cpu"
    exponent_in_n, exponent_in_n_large = _fits(lengths, by_length), _fits(lengths, by_length, config.large_length)
    results = {
        "clock": clock,
        "lengths": lengths,
        "dims": dims,
        "by_length": by_length,
        "by_dim": by_dim,
        f"by_length_{other}": both_by_length[other],
        f"by_dim_{other}": both_by_dim[other],
        f"exponent_in_n_large_{other}": _fits(lengths, both_by_length[other], config.large_length),
        "exponent_in_n": exponent_in_n,
        "exponent_in_n_large": exponent_in_n_large,
        "exponent_in_d": _fits(dims, by_dim),
        "time_per_token": {
            kind: {mode: [t / n for t, n in zip(times, lengths)] for mode, times in modes.items()}
            for kind, modes in by_length.items()
        },
        "sequential_steps": {"attention": [1 for _ in lengths], "rnn": list(lengths)},
        "theory": {
            "attention": "O(n^2 d + n d^2) work, O(1) sequential steps",
            "rnn": "O(n d^2) work, O(n) sequential steps",
        },
    }
    claims = {
        "attention time grows like n^2 for large n (exponent in [1.5, 2.5])": 1.5
        <= exponent_in_n_large["attention"]["forward"]
        <= 2.5,
        "RNN time grows like n (exponent in [0.7, 1.3])": 0.7 <= exponent_in_n["rnn"]["forward"] <= 1.3,
    }
    fig_name = "scaling.png"
    _plot(results, config, folder / fig_name)
    result = ExperimentResult(
        name=NAME,
        quick=quick,
        seed=seed,
        config=asdict(config) | {"device": str(dev)},
        results=rounded(results, 6),
        claims=claims,
        summary=_summary(results, config),
        figures=[fig_name],
        seconds=watch.seconds,
    )
    write_results(result, folder)
    return result


def _summary(results: dict, config: ScalingConfig) -> list[str]:
    lines = []
    for kind in LAYERS:
        for mode, times in results["by_length"][kind].items():
            cells = " ".join(f"{n}:{t * 1e3:.2f}" for n, t in zip(results["lengths"], times))
            lines.append(f"{kind:>9} {mode:>8} ms by n (d={config.fixed_dim}, {results['clock']} time): {cells}")
    for kind in LAYERS:
        n_all = results["exponent_in_n"][kind]
        n_large = results["exponent_in_n_large"][kind]
        d_all = results["exponent_in_d"][kind]
        text = "; ".join(
            f"{mode}: n^{n_all[mode]:.2f} (n >= {config.large_length}: n^{n_large[mode]:.2f}), d^{d_all[mode]:.2f}"
            for mode in n_all
        )
        lines.append(f"{kind:>9} fitted exponents  {text}")
    longest = results["lengths"][-1]
    lines.append(f"sequential steps at n={longest}: attention 1, rnn {longest}")
    return lines


def _plot(results: dict, config: ScalingConfig, path: Path) -> None:
    fig = new_figure(17, 4.4)
    ax_n, ax_d, ax_tok, ax_steps = fig.subplots(1, 4)
    colors = {"attention": "tab:blue", "rnn": "tab:red"}
    lines = {"forward": "-", "backward": "--"}
    for kind in LAYERS:
        for mode, times in results["by_length"][kind].items():
            p = results["exponent_in_n"][kind][mode]
            ax_n.loglog(
                results["lengths"],
                times,
                lines[mode],
                marker="o",
                color=colors[kind],
                label=f"{kind} {mode} (n^{p:.2f})",
            )
        for mode, times in results["by_dim"][kind].items():
            p = results["exponent_in_d"][kind][mode]
            ax_d.loglog(
                results["dims"], times, lines[mode], marker="o", color=colors[kind], label=f"{kind} {mode} (d^{p:.2f})"
            )
        for mode, per_token in results["time_per_token"][kind].items():
            ax_tok.loglog(
                results["lengths"],
                [t * 1e6 for t in per_token],
                lines[mode],
                marker="o",
                color=colors[kind],
                label=f"{kind} {mode}",
            )
    ax_n.set_xlabel("sequence length n")
    ax_n.set_ylabel(f"seconds (median, {results['clock']} time)")
    ax_n.set_title(f"time over n (d = {config.fixed_dim})", fontsize=9)
    ax_d.set_xlabel("model width d")
    ax_d.set_ylabel(f"seconds (median, {results['clock']} time)")
    ax_d.set_title(f"time over d (n = {config.fixed_length})", fontsize=9)
    ax_tok.set_xlabel("sequence length n")
    ax_tok.set_ylabel("microseconds per token")
    ax_tok.set_title("time per token", fontsize=9)
    for kind in LAYERS:
        ax_steps.loglog(
            results["lengths"], results["sequential_steps"][kind], marker="o", color=colors[kind], label=kind
        )
    ax_steps.set_xlabel("sequence length n")
    ax_steps.set_ylabel("sequential steps per layer")
    ax_steps.set_title("steps that must run one after another", fontsize=9)
    for ax in (ax_n, ax_d, ax_tok, ax_steps):
        ax.legend(fontsize=7)
    save_figure(fig, path)
