"""The decoder-only task: next-token prediction over one long token array, for a
:class:`~qkv.models.causal_lm.CausalLM` (the task protocol is in :mod:`qkv.training.tasks`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.models.causal_lm import IGNORE, CausalLM
from qkv.runtime.device import model_device
from qkv.runtime.precision import autocast_context
from qkv.training.objectives import LabelSmoothedCrossEntropy, Objective, Predictions, loss_keywords, stacked


@dataclass
class WindowBatch:
    """Windows of a token array: the model reads ``ids`` and predicts ``targets`` (``ids``
    shifted left by one)."""

    ids: Tensor  # (b, context)
    targets: Tensor  # (b, context)
    num_tgt_tokens: int  # predicted tokens (0: a zero-weight stand-in)

    def to(self, device: torch.device | str) -> WindowBatch:
        """The same windows on ``device`` (copied without blocking where the device allows it).

        Args:
            device: where the model runs.

        Returns:
            A new :class:`WindowBatch`; this one is left as it is.
        """
        return WindowBatch(
            self.ids.to(device, non_blocking=True), self.targets.to(device, non_blocking=True), self.num_tgt_tokens
        )


def language_model_loss(
    model: CausalLM,
    ids: Tensor,
    targets: Tensor,
    *,
    objective: Objective | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """The summed next-token loss of a batch of a :class:`~qkv.models.causal_lm.CausalLM` under
    ``objective``; the default objective (or none) runs the model's own
    :meth:`~qkv.models.causal_lm.CausalLM.loss` (arguments as :func:`~qkv.training.tasks.translation_loss`'s;
    ``targets`` is ``-100`` where nothing is predicted)."""
    if objective is None:  # a caller from before objectives
        return model.loss(ids, targets, label_smoothing=label_smoothing)
    if isinstance(objective, LabelSmoothedCrossEntropy):  # the default: the model's own loss, as with none
        return model.loss(ids, targets, label_smoothing=objective.label_smoothing)
    hidden = model.hidden_states(stacked(ids, objective.copies))
    return objective(Predictions(hidden, model.output_proj.weight, targets, IGNORE, chunked=model.chunked_loss))


class LanguageModelTask:
    """Next-token prediction over one long token array, for a :class:`~qkv.models.causal_lm.CausalLM`.

    An epoch is as many windows of ``context`` tokens as fit the training array end to end;
    ``windows="random"`` starts each at a random offset (nanoGPT's sampling), ``"strided"`` takes
    the non-overlapping windows in a shuffled order. A batch holds ``max_tokens // context``
    windows. Validation reads the validation array's non-overlapping windows in order.

    Raises:
        ValueError: a split shorter than one window.
    """

    loss_fn = staticmethod(language_model_loss)
    WINDOWS = ("random", "strided")

    def __init__(
        self,
        tokenizer: Any,
        train_tokens: np.ndarray,
        valid_tokens: np.ndarray | None,
        *,
        context: int,
        windows: str = "random",
        chars_per_token: float = 1.0,
    ) -> None:
        if windows not in self.WINDOWS:
            raise ValueError(f"windows must be one of {self.WINDOWS}, got {windows!r}")
        for name, tokens in (("training", train_tokens), ("validation", valid_tokens)):
            if tokens is not None and len(tokens) < context + 1:
                raise ValueError(
                    f"the {name} text has {len(tokens)} tokens, fewer than one window of the model's "
                    f"context ({context}) plus one: give more text or a smaller --context"
                )
        self.tokenizer, self.train_tokens, self.valid_tokens = tokenizer, train_tokens, valid_tokens
        self.context, self.windows, self.chars_per_token = context, windows, chars_per_token

    @property
    def num_examples(self) -> int:
        """The windows in an epoch: as many windows of ``context`` tokens (each with the token it
        predicts after it) as fit the training array end to end."""
        return (len(self.train_tokens) - 1) // self.context

    def batches(self, epoch: int, max_tokens: int, seed: int) -> list[list[int]]:
        """The epoch's batches as window start offsets, the same for every process."""
        rng = np.random.default_rng([seed, epoch])
        n = self.num_examples
        if self.windows == "random":
            starts = rng.integers(0, len(self.train_tokens) - self.context, size=n)
        else:
            starts = rng.permutation(n) * self.context
        per_batch = max(1, max_tokens // self.context)
        return [starts[i : i + per_batch].tolist() for i in range(0, n, per_batch)]

    def _windows(self, tokens: np.ndarray, starts: list[int]) -> WindowBatch:
        rows = np.stack([np.asarray(tokens[s : s + self.context + 1], dtype=np.int64) for s in starts])
        block = torch.from_numpy(rows)  # (b, context + 1)
        return WindowBatch(block[:, :-1], block[:, 1:], block[:, 1:].numel())

    def make_batch(self, starts: list[int], epoch: int = 0) -> WindowBatch:
        """The training windows that begin at the offsets ``starts`` (one of :meth:`batches`).

        Args:
            starts: the windows' start offsets into the training array.
            epoch: unused: a window reads the same tokens in every epoch (the task protocol's
                argument, for tasks that vary an example from pass to pass).

        Returns:
            A :class:`WindowBatch` of ``len(starts)`` windows of ``context`` tokens.
        """
        return self._windows(self.train_tokens, starts)

    @staticmethod
    def loss(module: nn.Module, batch: WindowBatch, objective: Objective) -> Tensor:
        """``module`` is the engine's wrapper that calls ``loss_fn`` (:func:`language_model_loss`)."""
        return module(batch.ids, batch.targets, **loss_keywords(objective))

    @torch.no_grad()
    def validate(self, model: CausalLM, windows: int, bf16: bool) -> dict | None:
        """Validation loss (nats per token), perplexity and bits per character over the first
        ``windows`` non-overlapping windows of the validation array."""
        if self.valid_tokens is None:
            return None
        starts = list(range(0, len(self.valid_tokens) - self.context, self.context))[:windows]
        device = model_device(model)
        total, tokens = 0.0, 0
        with autocast_context(device, bf16):
            for i in range(0, len(starts), 16):
                batch = self._windows(self.valid_tokens, starts[i : i + 16]).to(device)
                total += float(language_model_loss(model, batch.ids, batch.targets))
                tokens += batch.num_tgt_tokens
        loss = total / tokens
        return {
            "val_loss": round(loss, 4),
            "val_ppl": round(math.exp(min(loss, 700)), 3),
            "val_bpc": round(loss / math.log(2) / self.chars_per_token, 4),
            "windows": len(starts),
            "score": -loss,
        }
