"""The :class:`Task` protocol: what the :class:`~qkv.training.engine.Trainer` uses of a task.

A task is what one kind of model trains on; the engine owns the loop, the optimizer, checkpoints
and processes. :class:`~qkv.training.tasks.TranslationTask` and
:class:`~qkv.training.language_model_task.LanguageModelTask` satisfy it (checked by mypy where the
run kinds build a :class:`~qkv.training.engine.Trainer`). Methods that only some tasks have
(``set_subword_dropout``, ``drop_reversed_pairs``, ``both_directions``) are looked up by the research
methods that need them (:mod:`qkv.training.methods`), not required here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from qkv.training.objectives import Objective


class TrainingBatch(Protocol):
    """A batch as the engine handles it: moved to a device, weighed by its predicted tokens."""

    num_tgt_tokens: int

    def to(self, device: torch.device | str) -> Any:
        """The batch on ``device``."""
        ...


class Task(Protocol):
    """What the Trainer needs of a task.

    Attributes:
        tokenizer: the run's tokenizer (saved with the run, used by validation).
        loss_fn: ``loss_fn(model, *tensors, **keywords)``, the summed loss the engine wraps for DDP
            and FSDP2 (:func:`~qkv.training.distributed.wrap`).
    """

    tokenizer: Any

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        """The loss function the engine wraps for DDP and FSDP2."""
        ...

    @property
    def num_examples(self) -> int:
        """How many training examples (pairs, windows) an epoch holds."""
        ...

    def batches(self, epoch: int, max_tokens: int, seed: int) -> Sequence[list[int]]:
        """The epoch's batches as example indices, the same on every process.

        Args:
            epoch: the epoch (0 first).
            max_tokens: the tokens a batch may hold.
            seed: the run's seed.

        Returns:
            One list of example indices per batch.
        """
        ...

    def make_batch(self, indices: list[int], epoch: int = 0) -> Any:
        """The padded batch of ``indices`` (a :class:`TrainingBatch`); ``epoch`` lets a task vary an
        example from pass to pass (subword dropout)."""
        ...

    def loss(self, module: Any, batch: Any, objective: Objective) -> Tensor:
        """The summed loss over the batch's target tokens under ``objective``, through ``module`` (the
        wrapped, maybe compiled, :attr:`loss_fn`)."""
        ...

    def validate(self, model: Any, sentences: int, bf16: bool) -> dict | None:
        """A record of validation figures with ``score`` (higher is better: picks
        ``best.safetensors``), or None where there is nothing to validate on."""
        ...


__all__ = ["Task", "TrainingBatch"]
