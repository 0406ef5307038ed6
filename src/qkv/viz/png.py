"""Static attention heatmaps with matplotlib: one PNG per example, view and layer (heads side by side)."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from tqdm.auto import tqdm

from qkv.runtime.fileio import atomic_path
from qkv.viz.export import check_data

logger = logging.getLogger(__name__)


def _slug(text: str, limit: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "input"


def save_heatmaps(data: dict, out_dir: str | Path, *, max_columns: int = 6, progress: bool = False) -> list[Path]:
    """Write heatmaps of every layer of every view of every example.

    Args:
        data: a ``qkv-attention/1`` document (:func:`qkv.viz.export.explorer_data`).
        out_dir: the folder to write into (created if needed).
        max_columns: heads per row of subplots.
        progress: show a tqdm progress bar.

    Returns:
        The written paths, named ``<example number>-<sentence>-<view>-layer<l>.png``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    check_data(data)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [
        (e, example, view, layer)
        for e, example in enumerate(data["examples"])
        for view in example["views"]
        for layer in range(view["layers"])
    ]
    written = []
    for e, example, view, layer in tqdm(jobs, desc="heatmaps", unit="png", disable=not progress):
        heads = view["heads"]
        cols = min(heads, max_columns)
        rows = math.ceil(heads / cols)
        nq, nk = len(view["queries"]), len(view["keys"])
        cell = max(1.6, 0.22 * max(nq, nk))
        fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 0.6, rows * cell + 0.8), squeeze=False)
        for h in range(rows * cols):
            ax = axes[h // cols][h % cols]
            if h >= heads:
                ax.axis("off")
                continue
            ax.imshow(view["attention"][layer][h], cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"head {h}", fontsize=8)
            ax.set_xticks(range(nk))
            ax.set_yticks(range(nq))
            ax.set_xticklabels(view["keys"], rotation=90, fontsize=6)
            ax.set_yticklabels(view["queries"], fontsize=6)
        fig.suptitle(f"{example['text'][:60]} | {view['name']} | layer {layer}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{e:02d}-{_slug(example['text'])}-{_slug(view['name'])}-layer{layer}.png"
        try:
            with atomic_path(path) as tmp:
                fig.savefig(tmp, dpi=110, format="png")  # the temporary name ends in .tmp, not .png
        finally:
            plt.close(fig)
        written.append(path)
    logger.debug("wrote %d heatmaps to %s", len(written), out_dir)
    return written
