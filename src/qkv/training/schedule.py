"""A run's budget and its learning-rate schedule: when the budget (steps, minutes, epochs) is spent
and what ended a run, how much of it is spent, and the schedules of
:class:`~qkv.training.config.TrainConfig`'s ``schedule`` (the paper's inverse square root, its
budget-aware decay and a cosine, the last two following the budget)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.training.config import TrainConfig, TrainState


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


def _limits(config: TrainConfig, state: TrainState, epochs: float) -> list[tuple[bool, str, str]]:
    """The budget's limits that are set, as (reached, what, its value and option), in the order
    :func:`budget_spent` tests them."""
    c, s = config, state
    limits = [
        (c.max_steps, s.step >= c.max_steps, "max_steps", f"max_steps {c.max_steps}, --max-steps"),
        (
            c.max_minutes,
            s.seconds >= c.max_minutes * 60,
            "the time budget",
            f"max_minutes {c.max_minutes:g}, --minutes",
        ),
        (c.max_epochs, epochs >= c.max_epochs, "max_epochs", f"max_epochs {c.max_epochs:g}, --epochs"),
    ]
    return [(reached, what, value) for limit, reached, what, value in limits if limit]


def budget_spent(config: TrainConfig, state: TrainState, epochs: float) -> bool:
    """Whether the run is over: stopped early, or a limit of its budget reached.

    Args:
        config: the run's options.
        state: where it stands.
        epochs: passes over the data so far (fractional).
    """
    return state.stopped_early or any(reached for reached, _, _ in _limits(config, state, epochs))


def stop_reason(config: TrainConfig, state: TrainState, epochs: float) -> str:
    """What ended a run, in words for its final line: early stopping, or the first limit reached,
    with the limits that were still ahead.

    Args:
        config: the run's options.
        state: where it stopped.
        epochs: passes over the data (fractional).

    Returns:
        e.g. ``"stopped by the time budget (max_minutes 2, --minutes) before max_steps 200"``.
    """
    limits = _limits(config, state, epochs)
    ahead = [value.split(",")[0] for reached, _, value in limits if not reached]
    before = f" before {' or '.join(ahead)}" if ahead else ""
    if state.stopped_early:
        return f"stopped early: validation exact match reached {config.stop_at_exact_match:.1%}{before}"
    for reached, what, value in limits:
        if reached:
            return f"stopped by {what} ({value}){before}"
    return "stopped with no limit reached"


def time_left(config: TrainConfig, state: TrainState) -> str:
    """The time the run has left, ``m:ss``, by its time budget or its steps at their pace so far
    (``?`` before either says).

    Args:
        config: the run's options.
        state: where it stands.
    """
    remaining = [config.max_minutes * 60 - state.seconds] if config.max_minutes else []
    if config.max_steps and state.step:
        remaining.append(state.seconds / state.step * (config.max_steps - state.step))
    if not remaining:
        return "?"
    secs = max(0, int(min(remaining)))
    return f"{secs // 60}:{secs % 60:02d}"
