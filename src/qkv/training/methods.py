"""Training methods that a :class:`~qkv.training.config.TrainConfig` option switches on, scheduled by
the share of the budget spent (``progress``, as ``--schedule budget`` counts it: rank 0's, the same on
every process). They change what the steps see, never the model, and each is a
:class:`~qkv.training.hooks.StepHook` that the Trainer calls outside its step's body:

- R-Drop (``rdrop``, ``rdrop_start``): the step's objective from its start on, :class:`RDropFrom`
  (the objective itself is :class:`qkv.training.objectives.RDrop`);
- late dropout (``dropout_start``, Liu et al. 2023): the steps before it train with every dropout at 0
  (:func:`qkv.nn.dropout.dropout_off`), :class:`LateDropout`;
- both directions until (``both_directions_until``): a ``--both-directions`` translation goes on with
  the given direction alone from the next epoch on, :class:`BothDirectionsUntil`;
- subword dropout (``subword_dropout``): the task cuts its training pairs afresh every epoch
  (:mod:`qkv.data.subword_dropout`); set on the task once, :class:`SubwordDropoutSetup`, it needs no hook.

Each method checks its options and builds its hook in its ``from_config``; :data:`METHODS` lists them
and :func:`step_hooks` asks each in turn. A new method is a class here with a ``from_config`` and the
hook points it needs, one entry in :data:`METHODS`, and a test in ``tests/test_training_methods.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from qkv.nn.dropout import dropout_off
from qkv.training.config import TrainConfig, TrainState
from qkv.training.hooks import StepHook, StepHooks, TrainerView
from qkv.training.objectives import Objective, RDrop

logger = logging.getLogger(__name__)


class RDropFrom(StepHook):
    """``rdrop``: R-Drop's objective (:class:`~qkv.training.objectives.RDrop`) for the steps taken
    from ``start`` of the budget on; the steps before it keep the objective they had.

    Args:
        alpha: R-Drop's weight of the symmetric KL divergence.
        start: the share of the budget spent before R-Drop starts.
        label_smoothing: the run's ``eps``.
    """

    def __init__(self, *, alpha: float, start: float, label_smoothing: float) -> None:
        self.rdrop, self.start = RDrop(alpha=alpha, label_smoothing=label_smoothing), start

    @classmethod
    def from_config(cls, model: nn.Module, task: Any, config: TrainConfig) -> RDropFrom | None:
        """The hook of a run with ``rdrop`` set (None without); warns when the model has no dropout."""
        if not config.rdrop:
            return None
        if not getattr(getattr(model, "config", None), "dropout", 0.0):
            logger.warning(
                "--rdrop %g with a model without dropout: both passes give the same predictions, so the "
                "step costs twice as much for nothing",
                config.rdrop,
            )
        return cls(alpha=config.rdrop, start=config.rdrop_start, label_smoothing=config.label_smoothing)

    def objective(self, objective: Objective, progress: float) -> Objective:
        """R-Drop's objective once ``progress`` reaches the start, else ``objective``."""
        return self.rdrop if progress >= self.start else objective


class LateDropout(StepHook):
    """``dropout_start``: the steps taken before that share of the budget is spent run with every
    dropout of the model at 0; the first step after it is logged.

    Args:
        start: the share of the budget spent before dropout starts.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.was_off = False  # the last step ran with dropout off

    @classmethod
    def from_config(cls, model: nn.Module, task: Any, config: TrainConfig) -> LateDropout | None:
        """The hook of a run with ``dropout_start`` set (None without)."""
        return cls(config.dropout_start) if config.dropout_start else None

    def step(self, model: nn.Module, progress: float, step: int, *, log: bool) -> contextlib.AbstractContextManager:
        """The context step number ``step`` (1 for the first) runs in, ``progress`` of the budget spent;
        ``log``: this process logs (rank 0)."""
        held_off = progress < self.start
        if self.was_off and not held_off and log:
            logger.info("step %d on: dropout (%.0f%% of the budget spent)", step, 100 * progress)
        self.was_off = held_off
        return dropout_off(model) if held_off else contextlib.nullcontext()

    def around_step(self, trainer: TrainerView, step: int) -> contextlib.AbstractContextManager:
        """:meth:`step` for the Trainer's model and progress."""
        return self.step(trainer.model, trainer.progress, step, log=trainer.dist.is_main)


class BothDirectionsUntil(StepHook):
    """``both_directions_until``: once that share of the budget is spent, a ``--both-directions``
    task drops its reversed pairs at the start of the next epoch; the state records the epoch
    (``one_way_from_epoch``), so a resume drops them again."""

    @classmethod
    def from_config(cls, model: nn.Module, task: Any, config: TrainConfig) -> BothDirectionsUntil | None:
        """The hook of a task that holds reversed pairs (None for others).

        Raises:
            ValueError: ``both_directions_until`` below 1 for a task without reversed pairs.
        """
        both_directions = getattr(task, "both_directions", False)
        if config.both_directions_until < 1 and not both_directions:
            raise ValueError(
                "both_directions_until (--both-directions-until) says when to drop the reversed pairs: "
                "train a translation with --both-directions"
            )
        return cls() if both_directions else None

    def epoch_started(self, trainer: TrainerView) -> None:
        """Drop the reversed pairs when due (:func:`drop_reversed_pairs_when_due`)."""
        drop_reversed_pairs_when_due(
            trainer.task, trainer.config, trainer.state, trainer.progress, log=trainer.dist.is_main
        )

    def resumed(self, trainer: TrainerView) -> None:
        """A run saved past its ``both_directions_until`` trains one way again."""
        if trainer.state.one_way_from_epoch >= 0:
            trainer.task.drop_reversed_pairs()
            trainer.forget_batches()  # any epoch's batches made before are rebuilt


class SubwordDropoutSetup:
    """``subword_dropout``: set once on the task, which cuts its training pairs afresh every epoch
    (:meth:`~qkv.training.tasks.TranslationTask.set_subword_dropout`); no hook is needed."""

    @classmethod
    def from_config(cls, model: nn.Module, task: Any, config: TrainConfig) -> None:
        """Set the task's subword dropout.

        Raises:
            ValueError: ``subword_dropout`` for a task without subword tokens.
        """
        if config.subword_dropout:
            if not hasattr(task, "set_subword_dropout"):
                raise ValueError("--subword-dropout splits subword tokens of translation pairs; this task has none")
            task.set_subword_dropout(config.subword_dropout, config.seed)


#: Each method's ``from_config(model, task, config)``: checks the options, sets up what it needs and
#: returns its hook (None: nothing to do during the steps), in this order.
METHODS: tuple[Callable[[nn.Module, Any, TrainConfig], StepHook | None], ...] = (
    RDropFrom.from_config,
    LateDropout.from_config,
    BothDirectionsUntil.from_config,
    SubwordDropoutSetup.from_config,
)


def step_hooks(model: nn.Module, task: Any, config: TrainConfig) -> StepHooks:
    """The hooks of the methods ``config`` switches on, each checked and set up (:data:`METHODS`).

    Args:
        model: the model trained.
        task: the training task (:mod:`qkv.training.tasks`).
        config: the run's options.

    Returns:
        The run's :class:`~qkv.training.hooks.StepHooks`.

    Raises:
        ValueError: a method ``task`` cannot take (see each method's ``from_config``).
    """
    hooks = [hook for make in METHODS if (hook := make(model, task, config)) is not None]
    return StepHooks(hooks)


def check_methods(model: nn.Module, task: Any, config: TrainConfig) -> None:
    """Refuse the methods ``task`` cannot take, warn about R-Drop on a model without dropout, and set
    the task's subword dropout: :func:`step_hooks` without keeping the hooks.

    Args:
        model: the model trained.
        task: the training task (:mod:`qkv.training.tasks`).
        config: the run's options.

    Raises:
        ValueError: ``both_directions_until`` below 1 for a task without reversed pairs, or
            ``subword_dropout`` for a task without subword tokens.
    """
    step_hooks(model, task, config)


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
