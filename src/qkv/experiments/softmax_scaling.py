"""Why attention divides by sqrt(d_k) (section 3.2.1, footnote 4).

If the components of ``q`` and ``k`` are independent with mean 0 and variance 1, then
``q . k = sum_i q_i k_i`` has mean 0 and variance ``d_k``. Unscaled scores therefore spread out
as ``d_k`` grows, the softmax puts almost all its weight on one key, and its Jacobian
``diag(p) - p p^T`` (the gradient with respect to the scores) tends to zero: training stalls.
Dividing by ``sqrt(d_k)`` brings the variance back to 1 for every ``d_k``.

Shape legend: ``m`` sampled queries, ``n`` keys per query, ``d`` d_k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.experiments.common import (
    ExperimentResult,
    Stopwatch,
    experiment_dir,
    new_figure,
    rounded,
    save_figure,
    seeded,
    write_results,
)

NAME = "softmax-scaling"


@dataclass(frozen=True)
class SoftmaxScalingConfig:
    """Sizes of the softmax-scaling experiment."""

    dims: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024)  # d_k values
    num_queries: int = 4000  # sampled queries per d_k
    num_keys: int = 16  # keys each query attends over
    demo_size: int = 8  # length of the "scores times 100" vector
    demo_factor: float = 100.0  # the factor the demo multiplies the scores by

    def __post_init__(self) -> None:
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"dims must be positive integers, got {self.dims}")
        if self.num_queries < 2 or self.num_keys < 2:
            raise ValueError(f"need at least 2 queries and 2 keys, got {self.num_queries} and {self.num_keys}")


QUICK = SoftmaxScalingConfig(num_queries=500)


def softmax_jacobian(p: Tensor) -> Tensor:
    """The Jacobian of ``softmax`` at output ``p``: ``d p_i / d s_j = p_i (delta_ij - p_j)``.

    Shape:
        ``p (..., n)`` -> ``(..., n, n)``.
    """
    return torch.diag_embed(p) - p[..., :, None] * p[..., None, :]


def softmax_statistics(scores: Tensor) -> dict[str, float]:
    """Mean over rows of the largest softmax weight, the entropy (nats) and the Frobenius norm of
    the softmax's Jacobian with respect to the scores.

    Args:
        scores: ``(m, n)``, one row of scores per query.
    """
    p = torch.softmax(scores, dim=-1)  # (m, n)
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)  # 0 log 0 = 0
    jacobian_norm = torch.linalg.matrix_norm(softmax_jacobian(p))  # (m,) Frobenius
    return {
        "max_weight": p.max(-1).values.mean().item(),
        "entropy": entropy.mean().item(),
        "grad_norm": jacobian_norm.mean().item(),
        "grad_norm_median": jacobian_norm.median().item(),
    }


def measure(config: SoftmaxScalingConfig, generator: torch.Generator) -> dict:
    """The statistics for every ``d_k``, unscaled and scaled, from standard-normal ``q`` and ``k``."""
    out: dict = {"dims": list(config.dims), "unscaled": {}, "scaled": {}}
    rows: dict[str, dict[str, list[float]]] = {"unscaled": {}, "scaled": {}}
    variance: dict[str, list[float]] = {"unscaled": [], "scaled": []}
    for d in config.dims:
        q = torch.randn(config.num_queries, 1, d, generator=generator, dtype=torch.float64)  # (m, 1, d)
        k = torch.randn(config.num_queries, config.num_keys, d, generator=generator, dtype=torch.float64)  # (m, n, d)
        raw = (q * k).sum(-1)  # (m, n): q . k
        for kind, scores in (("unscaled", raw), ("scaled", raw / math.sqrt(d))):
            variance[kind].append(scores.var().item())
            for key, value in softmax_statistics(scores).items():
                rows[kind].setdefault(key, []).append(value)
    for kind in ("unscaled", "scaled"):
        out[kind] = {"variance": variance[kind], **rows[kind]}
    out["num_keys"] = config.num_keys
    out["max_entropy"] = math.log(config.num_keys)
    return out


def times_factor_demo(config: SoftmaxScalingConfig, generator: torch.Generator) -> dict:
    """softmax(x) against softmax(factor * x) for one random vector ``x`` of ``demo_size`` scores."""
    x = torch.randn(config.demo_size, generator=generator, dtype=torch.float64).round(decimals=2)
    demo = {"scores": x.tolist(), "factor": config.demo_factor}
    for kind, scores in (("plain", x), ("multiplied", x * config.demo_factor)):
        p = torch.softmax(scores, -1)
        stats = softmax_statistics(scores[None])
        demo[kind] = {"weights": p.tolist(), **stats}
    return demo


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: SoftmaxScalingConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Measure the saturation of the softmax with and without 1/sqrt(d_k); write results.json and
    ``softmax_scaling.png`` under ``<out>/softmax-scaling``. (Runs on the CPU in float64: tiny.)"""
    del device, progress  # small enough to need neither
    config = config or (QUICK if quick else SoftmaxScalingConfig())
    folder = experiment_dir(out, NAME)
    with Stopwatch() as watch, seeded(seed):
        generator = torch.Generator().manual_seed(seed)
        results = measure(config, generator)
        results["demo"] = times_factor_demo(config, generator)
    claims = _claims(results)
    summary = _summary(results)
    fig_name = "softmax_scaling.png"
    _plot(results, folder / fig_name)
    result = ExperimentResult(
        name=NAME,
        quick=quick,
        seed=seed,
        config=asdict(config),
        results=rounded(results, 6),
        claims=claims,
        summary=summary,
        figures=[fig_name],
        seconds=watch.seconds,
    )
    write_results(result, folder)
    return result


def _spread(values: list[float]) -> float:
    """max / min: 1 means the value stays put."""
    return max(values) / min(values)


def _claims(results: dict) -> dict[str, bool]:
    un, sc = results["unscaled"], results["scaled"]
    return {
        "unscaled largest weight tends to 1": un["max_weight"][-1] > 0.95
        and un["max_weight"][-1] > un["max_weight"][0],
        "unscaled gradient norm tends to 0": un["grad_norm"][-1] < 0.25 * min(un["grad_norm"][0], sc["grad_norm"][-1])
        and un["grad_norm_median"][-1] < 0.01 * un["grad_norm_median"][0],
        "scaled largest weight stays put": _spread(sc["max_weight"]) < 1.25,
        "scaled gradient norm stays put": _spread(sc["grad_norm"]) < 1.25 and _spread(sc["grad_norm_median"]) < 1.5,
    }


def _summary(results: dict) -> list[str]:
    dims = results["dims"]
    lines = [
        f"{results['num_keys']} keys per query; |grad| = mean Frobenius norm of d softmax / d scores",
        f"{'d_k':>6} | {'var q.k':>9} {'max w':>7} {'entropy':>8} {'|grad|':>8} | scaled: "
        f"{'var':>6} {'max w':>7} {'entropy':>8} {'|grad|':>8}",
    ]
    un, sc = results["unscaled"], results["scaled"]
    for i, d in enumerate(dims):
        lines.append(
            f"{d:>6} | {un['variance'][i]:>9.1f} {un['max_weight'][i]:>7.3f} {un['entropy'][i]:>8.3f} "
            f"{un['grad_norm'][i]:>8.4f} |         {sc['variance'][i]:>6.2f} {sc['max_weight'][i]:>7.3f} "
            f"{sc['entropy'][i]:>8.3f} {sc['grad_norm'][i]:>8.4f}"
        )
    demo = results["demo"]
    lines.append(
        f"scores x{demo['factor']:g}: largest weight {demo['plain']['max_weight']:.3f} -> "
        f"{demo['multiplied']['max_weight']:.6f}, gradient norm {demo['plain']['grad_norm']:.3f} -> "
        f"{demo['multiplied']['grad_norm']:.2e}"
    )
    return lines


def _plot(results: dict, path: Path) -> None:
    fig = new_figure(13, 7)
    axes = fig.subplots(2, 3)
    dims = results["dims"]
    styles = {
        "unscaled": dict(color="tab:red", marker="o", label="q.k"),
        "scaled": dict(color="tab:blue", marker="s", label="q.k / sqrt(d_k)"),
    }
    panels = [
        (axes[0][0], "variance", "variance of the score", True),
        (axes[0][1], "max_weight", "largest softmax weight", False),
        (axes[0][2], "entropy", "entropy of the weights (nats)", False),
        (axes[1][0], "grad_norm", "||d softmax / d scores||_F", True),
    ]
    for ax, key, label, logy in panels:
        for kind, style in styles.items():
            ax.plot(dims, results[kind][key], **style)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("d_k")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    for kind, style in styles.items():
        axes[1][0].plot(
            dims, results[kind]["grad_norm_median"], ls="--", color=style["color"], label=f"{style['label']} (median)"
        )
    axes[1][0].legend(fontsize=8)
    axes[0][2].axhline(results["max_entropy"], color="gray", ls=":", label="uniform (log n)")
    axes[0][2].legend(fontsize=8)
    axes[0][0].set_title("q.k has variance d_k")
    axes[0][1].set_title("unscaled: one key takes everything")
    axes[0][2].set_title("unscaled: the distribution collapses")
    axes[1][0].set_title("unscaled: the gradient vanishes")
    demo = results["demo"]
    positions = range(len(demo["scores"]))
    for ax, kind, title in (
        (axes[1][1], "plain", "softmax(x)"),
        (axes[1][2], "multiplied", f"softmax({demo['factor']:g} x)"),
    ):
        ax.bar(positions, demo[kind]["weights"], color="tab:blue" if kind == "plain" else "tab:red")
        ax.set_ylim(0, 1.05)
        ax.set_xticks(list(positions))
        ax.set_xticklabels([f"{v:.2f}" for v in demo["scores"]], rotation=45, fontsize=7)
        ax.set_xlabel("score x_i")
        ax.set_title(f"{title}: max {demo[kind]['max_weight']:.3f}, |grad| {demo[kind]['grad_norm']:.1e}", fontsize=9)
    save_figure(fig, path)
