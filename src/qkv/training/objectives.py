"""Training objectives: what a training step minimises, chosen by name here in the training layer.

A model's own ``loss`` is the label-smoothed cross-entropy and nothing else; research methods that
change the loss (R-Drop) are objectives, as fairseq's criteria are: the model and the default path
never see them. A task (:mod:`qkv.training.tasks`) runs the model on a batch and hands the objective
:class:`Predictions` (the final hidden states and the output projection, so that the loss can project
a chunk of rows at a time and never hold the logits); the objective returns the summed loss.

- ``label_smoothed_cross_entropy`` (:class:`LabelSmoothedCrossEntropy`): the default, section 5.4;
- ``rdrop`` (:class:`RDrop`): each batch twice with different dropout, plus ``alpha`` times the two
  predictions' symmetric KL divergence (:mod:`qkv.training.rdrop`).

:func:`step_objective` picks a step's objective from the run's :class:`~qkv.training.config.TrainConfig`
(``--rdrop`` from ``--rdrop-start`` on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.loss import fused_linear_cross_entropy, label_smoothed_cross_entropy
from qkv.training.config import TrainConfig
from qkv.training.rdrop import fused_linear_rdrop_cross_entropy, rdrop_cross_entropy


@dataclass(frozen=True)
class Predictions:
    """What a model made of a batch, as an objective reads it.

    ``hidden`` holds the final hidden states of ``copies`` passes over the batch, stacked along the
    batch dimension (the objective's ``copies``); ``weight @ hidden`` are the logits.
    """

    hidden: Tensor  # (copies * b, s, d)
    weight: Tensor  # (V, d) the output projection
    target: Tensor  # (b, s) the ids to predict
    ignore_index: int  # the target id that adds nothing (padding)
    chunked: bool = True  # project a chunk of rows at a time; False: the whole logits (V no wider than d)


class Objective(Protocol):
    """A training objective: ``objective(predictions)`` is the summed loss over the real target positions."""

    @property
    def name(self) -> str:
        """The name :func:`make_objective` knows it by."""
        ...

    @property
    def copies(self) -> int:
        """How many times each batch runs through the model (stacked in one pass)."""
        ...

    @property
    def label_smoothing(self) -> float:
        """``eps`` of the smoothed target distribution."""
        ...

    def __call__(self, predictions: Predictions) -> Tensor: ...


def _check_smoothing(value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {value!r}")


@dataclass(frozen=True)
class LabelSmoothedCrossEntropy:
    """The summed label-smoothed cross-entropy (section 5.4; ``label_smoothing`` 0: plain cross-entropy)."""

    label_smoothing: float = 0.0
    name: ClassVar[str] = "label_smoothed_cross_entropy"
    copies: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check_smoothing(self.label_smoothing)

    def __call__(self, predictions: Predictions) -> Tensor:
        p, eps = predictions, self.label_smoothing
        if p.chunked:
            return fused_linear_cross_entropy(p.hidden, p.weight, p.target, eps, p.ignore_index)
        return label_smoothed_cross_entropy(F.linear(p.hidden, p.weight), p.target, eps, p.ignore_index)


@dataclass(frozen=True)
class RDrop:
    """R-Drop (Liang et al. 2021): the batch runs twice (each copy draws its own dropout) and the loss
    is the two copies' mean label-smoothed cross-entropy plus ``alpha`` times half their symmetric KL
    divergence (:mod:`qkv.training.rdrop`)."""

    alpha: float
    label_smoothing: float = 0.0
    name: ClassVar[str] = "rdrop"
    copies: ClassVar[int] = 2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"R-Drop's alpha must be a positive number, got {self.alpha!r}")
        _check_smoothing(self.label_smoothing)

    def __call__(self, predictions: Predictions) -> Tensor:
        p, eps = predictions, self.label_smoothing
        hidden_a, hidden_b = p.hidden.chunk(2)
        if p.chunked:
            return fused_linear_rdrop_cross_entropy(
                hidden_a, hidden_b, p.weight, p.target, eps, p.ignore_index, self.alpha
            )
        logits_a, logits_b = F.linear(hidden_a, p.weight), F.linear(hidden_b, p.weight)
        return rdrop_cross_entropy(logits_a, logits_b, p.target, eps, p.ignore_index, self.alpha)


OBJECTIVES: dict[str, type] = {kind.name: kind for kind in (LabelSmoothedCrossEntropy, RDrop)}
DEFAULT_OBJECTIVE = LabelSmoothedCrossEntropy.name


def make_objective(name: str, **options: Any) -> Objective:
    """The objective called ``name`` with ``options``.

    Args:
        name: one of :data:`OBJECTIVES` (``label_smoothed_cross_entropy``, ``rdrop``).
        options: the objective's fields, e.g. ``label_smoothing=0.1``, ``alpha=3.0``.

    Returns:
        The objective.

    Raises:
        ValueError: an unknown name, option or value.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown training objective {name!r}; choose one of {sorted(OBJECTIVES)}")
    try:
        return OBJECTIVES[name](**options)
    except TypeError as err:
        raise ValueError(f"objective {name!r} takes no options {sorted(options)}: {err}") from None


def step_objective(config: TrainConfig, progress: float) -> Objective:
    """The objective of a training step taken once ``progress`` of the budget is spent.

    Args:
        config: the run's options: ``rdrop`` (R-Drop's alpha, 0: off), ``rdrop_start`` (the share of
            the budget before R-Drop starts) and ``label_smoothing``.
        progress: the share of the budget spent (:func:`~qkv.training.schedule.budget_progress`).

    Returns:
        R-Drop's objective from ``rdrop_start`` on when ``rdrop`` is set, else label-smoothed cross-entropy.
    """
    if config.rdrop and progress >= config.rdrop_start:
        return make_objective(RDrop.name, alpha=config.rdrop, label_smoothing=config.label_smoothing)
    return make_objective(DEFAULT_OBJECTIVE, label_smoothing=config.label_smoothing)


def loss_keywords(objective: Objective) -> dict[str, Any]:
    """The keywords of a task's loss call (``loss_fn(model, *tensors, **keywords)``) for ``objective``.

    Label smoothing has one channel: the objective, which holds its own ``eps``. A loss function
    given the default objective (:class:`LabelSmoothedCrossEntropy`) computes it with the model's
    own ``loss``, passing ``objective.label_smoothing`` on, so the default path never sees the other
    objectives' code; a loss function that knows only label-smoothed cross-entropy (the benchmarks'
    other contenders) reads the same field.

    Args:
        objective: the step's objective.

    Returns:
        ``{"objective": objective}``.
    """
    return {"objective": objective}


def cross_entropy_smoothing(objective: Objective | None) -> float:
    """The ``eps`` for a loss function that knows only label-smoothed cross-entropy (a benchmark's
    other contender, a Hugging Face model's loss): the default objective's own.

    Args:
        objective: the step's objective; None: plain cross-entropy.

    Returns:
        ``objective.label_smoothing`` (0 for None).

    Raises:
        ValueError: another objective (R-Drop), which such a loss function cannot compute.
    """
    if objective is None:
        return 0.0
    if not isinstance(objective, LabelSmoothedCrossEntropy):
        raise ValueError(f"this loss knows only label-smoothed cross-entropy, not objective {objective.name!r}")
    return objective.label_smoothing


def only_one_smoothing(objective: Objective, label_smoothing: float) -> None:
    """Kept importable for older callers; checks nothing. A loss call takes its smoothing from its
    objective alone (:func:`loss_keywords`), so no call holds two to refuse.

    Args:
        objective: the loss call's objective (unused).
        label_smoothing: a smoothing given beside it (unused).
    """
    del objective, label_smoothing


def stacked(tensor: Tensor, copies: int) -> Tensor:
    """``copies`` copies of a batch stacked along its first dimension (one pass in which each copy
    draws its own dropout); the batch itself for one copy."""
    return tensor if copies == 1 else torch.cat([tensor] * copies)
