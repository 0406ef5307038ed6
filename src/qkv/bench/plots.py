"""Plots for the benchmark reports (matplotlib, Agg backend), written atomically."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from qkv.runtime.fileio import atomic_path

if TYPE_CHECKING:  # matplotlib is imported only where a plot is drawn
    from matplotlib.figure import Figure


def _save(fig: Figure, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return Path(path)


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_panels(
    panels: dict[str, dict[str, list[tuple[float, float]]]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    log: bool = False,
    title: str = "",
) -> Path:
    """One small line chart per panel: ``panels[title][series] = [(x, y), ...]``."""
    plt = _pyplot()
    n = max(1, len(panels))
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        for name, points in sorted(series.items()):
            points = sorted(points)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if log:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = next(iter(axes.flat)).get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(7, len(labels)), fontsize=8)
    if title:
        fig.suptitle(title, y=0.995, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if rows == 1 else 0.96))
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def bar_chart(values: dict[str, float], path: str | Path, *, ylabel: str, title: str = "") -> Path:
    """Horizontal bars, one per named value (e.g. tokens/s per contender)."""
    plt = _pyplot()
    names = list(values)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
    ax.barh(names, [values[n] for n in names], color="tab:blue")
    for i, name in enumerate(names):
        ax.text(values[name], i, f" {values[name]:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
