"""The learning-rate schedules of a run (:class:`~qkv.training.config.TrainConfig`'s ``schedule``):
the paper's inverse square root, its budget-aware decay and a cosine, and how much of a run's budget
is spent, which the last two follow."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.training.config import TrainConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """The paper's learning rate (section 5.3, eq. 3) at optimizer step ``step`` (1-based):
    ``factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def budget_progress(config: TrainConfig, *, step: int, seconds: float, epochs: float) -> float:
    """How much of the run's budget is spent, in [0, 1]: the largest of the fractions of
    ``max_minutes``, ``max_steps`` and ``max_epochs`` used so far (those that are set)."""
    spent = [0.0]
    if config.max_minutes:
        spent.append(seconds / (config.max_minutes * 60))
    if config.max_steps:
        spent.append(step / config.max_steps)
    if config.max_epochs:
        spent.append(epochs / config.max_epochs)
    return min(1.0, max(spent))


def learning_rate(config: TrainConfig, step: int, d_model: int, progress: float = 0.0) -> float:
    """The rate of optimizer step ``step`` (1-based). ``inverse_sqrt``: :func:`inverse_sqrt_lr`.
    ``budget``: the same, times a ramp that is 1 until ``1 - decay_fraction`` of the budget is spent
    (``progress``, see :func:`budget_progress`) and then falls linearly to 0 at its end, so a run
    with a fixed budget ends on a small rate (budget-aware decay, Li et al. 2020) instead of wherever
    the inverse square root has reached. ``cosine``: the paper's linear warmup to its peak
    (``lr_factor * d_model^-0.5 * warmup_steps^-0.5``), then ``peak * (1 + cos(pi * progress)) / 2``,
    zero at the budget's end (as nanoGPT's, which stops at a tenth of the peak)."""
    if config.schedule == "cosine":
        warmup = config.warmup_steps
        peak = inverse_sqrt_lr(warmup, d_model, warmup, config.lr_factor)
        if step < warmup:
            return peak * max(step, 1) / warmup
        return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    lr = inverse_sqrt_lr(step, d_model, config.warmup_steps, config.lr_factor)
    if config.schedule == "budget":
        lr *= min(1.0, max(0.0, (1.0 - progress) / config.decay_fraction))
    return lr
