"""Training curves: loss and validation BLEU against minutes, from a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qkv.runtime.fileio import atomic_path

logger = logging.getLogger(__name__)


def read_metrics(metrics_path: str | Path) -> list[dict]:
    """The JSON records of ``metrics.jsonl``; a line cut short by a crash is skipped."""
    records = []
    for line in Path(metrics_path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def plot_metrics(metrics_path: str | Path, png_path: str | Path) -> None:
    """Draw training loss and validation loss and BLEU (or bits/char) against minutes into a PNG (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    fig, ax_loss = plt.subplots(figsize=(7, 4))
    ax_loss.plot([r["minutes"] for r in train], [r["loss"] for r in train], color="tab:blue", label="train loss")
    if valid:
        ax_loss.plot(
            [r["minutes"] for r in valid], [r["val_loss"] for r in valid], "o-", color="tab:cyan", label="val loss"
        )
    ax_loss.set_xlabel("minutes")
    ax_loss.set_ylabel("loss (nats/token)")
    # the task's own validation figure on the right: BLEU for translation, bits/char for a language model
    for key, label, axis in (
        ("val_bleu_greedy", "val BLEU (greedy)", "BLEU"),
        ("val_bpc", "val bits/char", "bits/char"),
    ):
        if valid and all(key in r for r in valid):
            ax_right = ax_loss.twinx()
            ax_right.plot([r["minutes"] for r in valid], [r[key] for r in valid], "s-", color="tab:red", label=label)
            ax_right.set_ylabel(axis)
            ax_right.legend(loc="center right")
            break
    ax_loss.legend(loc="upper right")
    fig.tight_layout()
    try:
        with atomic_path(png_path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
