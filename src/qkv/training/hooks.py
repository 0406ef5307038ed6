"""Step hooks: where a research method meets the training loop, outside :meth:`Trainer.step`'s body.

:meth:`~qkv.training.engine.Trainer.step` is forward, backward, clipping, schedule and optimizer; the
loop around it builds batches, validates and saves. A research method that changes what the steps see
(:mod:`qkv.training.methods`) is a :class:`StepHook`: it may replace the step's objective, wrap the
step in a context, act when an epoch starts and restore its effect after a resume. The
:class:`~qkv.training.engine.Trainer` holds its run's hooks in one :class:`StepHooks` (built by
:func:`qkv.training.methods.step_hooks` from the run's options) and calls them at those four points
and nowhere else, so the step and the loop carry no method-specific code.

A hook sees the Trainer through :class:`TrainerView` (the attributes it may read, and
:meth:`~TrainerView.forget_batches`), so this module needs nothing from the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch import nn

from qkv.training.config import TrainConfig, TrainState
from qkv.training.distributed import Distributed
from qkv.training.objectives import Objective


class TrainerView(Protocol):
    """What a :class:`StepHook` may see of the :class:`~qkv.training.engine.Trainer`."""

    model: nn.Module  # the model trained (not its DDP or FSDP wrapper)
    task: Any  # the training task (qkv.training.tasks)
    config: TrainConfig
    state: TrainState  # the position in the run, saved with each checkpoint
    progress: float  # the share of the budget spent (rank 0's, the same on every process)
    dist: Distributed

    def forget_batches(self) -> None:
        """Drop the batches built for the current epoch (the task's data changed): the next use rebuilds them."""
        ...


class StepHook:
    """A research method's place in the loop; each of the four points does nothing unless a method
    overrides it. A hook keeps no state that a resume would have to restore, except through
    :class:`~qkv.training.config.TrainState` (saved with every checkpoint) and :meth:`resumed`."""

    def objective(self, objective: Objective, progress: float) -> Objective:
        """The objective of a step taken once ``progress`` of the budget is spent.

        Args:
            objective: the objective so far (the run's default, or an earlier hook's).
            progress: the share of the budget spent.

        Returns:
            The objective the step minimises.
        """
        return objective

    def around_step(self, trainer: TrainerView, step: int) -> contextlib.AbstractContextManager[Any]:
        """The context that step number ``step`` (1 for the first) runs its forward and backward passes in.

        Args:
            trainer: the Trainer taking the step.
            step: the step's number.

        Returns:
            A context manager.
        """
        return contextlib.nullcontext()

    def epoch_started(self, trainer: TrainerView) -> None:
        """Called when the loop moves to epoch ``trainer.state.epoch``, before its batches are built."""

    def resumed(self, trainer: TrainerView) -> None:
        """Called once a resume has restored ``trainer.state``: redo what the saved state says was done."""


class StepHooks:
    """The run's hooks, called in the order given.

    Args:
        hooks: the hooks (:func:`qkv.training.methods.step_hooks` builds a run's).
    """

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        self.hooks = tuple(hooks)

    def __iter__(self) -> Iterator[StepHook]:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def objective(self, objective: Objective, progress: float) -> Objective:
        """``objective`` as the hooks replace it, one after the other (see :meth:`StepHook.objective`)."""
        for hook in self.hooks:
            objective = hook.objective(objective, progress)
        return objective

    def around_step(self, trainer: TrainerView, step: int) -> contextlib.AbstractContextManager[Any]:
        """Every hook's context for step ``step``, entered in order (see :meth:`StepHook.around_step`)."""
        if not self.hooks:
            return contextlib.nullcontext()
        if len(self.hooks) == 1:
            return self.hooks[0].around_step(trainer, step)
        return self._all_around(trainer, step)

    @contextlib.contextmanager
    def _all_around(self, trainer: TrainerView, step: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.around_step(trainer, step))
            yield

    def epoch_started(self, trainer: TrainerView) -> None:
        """Tell every hook that epoch ``trainer.state.epoch`` starts."""
        for hook in self.hooks:
            hook.epoch_started(trainer)

    def resumed(self, trainer: TrainerView) -> None:
        """Tell every hook that a resume restored ``trainer.state``."""
        for hook in self.hooks:
            hook.resumed(trainer)
