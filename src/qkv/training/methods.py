"""Training methods that a :class:`~qkv.training.config.TrainConfig` option switches on, scheduled by
the share of the budget spent (``progress``, as ``--schedule budget`` counts it: rank 0's, the same on
every process). They change what the steps see, never the model:

- R-Drop (``rdrop``, ``rdrop_start``): the step's objective, :func:`qkv.training.objectives.step_objective`;
- late dropout (``dropout_start``, Liu et al. 2023): the steps before it train with every dropout at 0
  (:func:`qkv.nn.dropout.dropout_off`), :class:`LateDropout`;
- both directions until (``both_directions_until``): a ``--both-directions`` translation goes on with
  the given direction alone from the next epoch on, :func:`drop_reversed_pairs_when_due`;
- subword dropout (``subword_dropout``): the task cuts its training pairs afresh every epoch
  (:mod:`qkv.data.subword_dropout`), set up by :func:`check_methods`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from qkv.nn.dropout import dropout_off
from qkv.training.config import TrainConfig, TrainState

logger = logging.getLogger(__name__)


def check_methods(model: nn.Module, task: Any, config: TrainConfig) -> None:
    """Refuse the methods ``task`` cannot take, warn about R-Drop on a model without dropout, and set
    the task's subword dropout.

    Args:
        model: the model trained.
        task: the training task (:mod:`qkv.training.tasks`).
        config: the run's options.

    Raises:
        ValueError: ``both_directions_until`` below 1 for a task without reversed pairs, or
            ``subword_dropout`` for a task without subword tokens.
    """
    if config.rdrop and not getattr(getattr(model, "config", None), "dropout", 0.0):
        logger.warning(
            "--rdrop %g with a model without dropout: both passes give the same predictions, so the "
            "step costs twice as much for nothing",
            config.rdrop,
        )
    if config.both_directions_until < 1 and not getattr(task, "both_directions", False):
        raise ValueError(
            "both_directions_until (--both-directions-until) says when to drop the reversed pairs: "
            "train a translation with --both-directions"
        )
    if config.subword_dropout:
        if not hasattr(task, "set_subword_dropout"):
            raise ValueError("--subword-dropout splits subword tokens of translation pairs; this task has none")
        task.set_subword_dropout(config.subword_dropout, config.seed)


class LateDropout:
    """``dropout_start``: the steps taken before that share of the budget is spent run with every
    dropout of the model at 0; the first step after it is logged."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.was_off = False  # the last step ran with dropout off

    def step(self, model: nn.Module, progress: float, step: int, *, log: bool) -> contextlib.AbstractContextManager:
        """The context step number ``step`` (1 for the first) runs in, ``progress`` of the budget spent;
        ``log``: this process logs (rank 0)."""
        held_off = progress < self.start
        if self.was_off and not held_off and log:
            logger.info("step %d on: dropout (%.0f%% of the budget spent)", step, 100 * progress)
        self.was_off = held_off
        return dropout_off(model) if held_off else contextlib.nullcontext()


def drop_reversed_pairs_when_due(
    task: Any, config: TrainConfig, state: TrainState, progress: float, *, log: bool
) -> None:
    """At the start of epoch ``state.epoch``: once ``both_directions_until`` of the budget is spent, the
    task drops its reversed pairs, and ``state.one_way_from_epoch`` records the epoch (saved with the
    state, so a resume drops them again). ``log``: this process logs (rank 0)."""
    if config.both_directions_until >= 1 or state.one_way_from_epoch >= 0 or progress < config.both_directions_until:
        return
    state.one_way_from_epoch = state.epoch
    task.drop_reversed_pairs()
    if log:
        logger.info("epoch %d on: the given direction alone (%.0f%% of the budget spent)", state.epoch, 100 * progress)
