"""The classic explanations of attention, each a function that computes, measures and draws its claim.

Every experiment module has ``NAME`` and ``run(*, out, quick=False, seed=0, device=None, ...)``
returning an :class:`~qkv.experiments.common.ExperimentResult` after writing
``<out>/<NAME>/results.json`` and its PNG figures. ``qkv experiment NAME`` runs one; ``qkv report``
gathers them into one HTML page (:mod:`qkv.experiments.report`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from qkv.experiments.common import ExperimentResult

# name -> (module, one-line claim)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "softmax-scaling": (
        "qkv.experiments.softmax_scaling",
        "dividing by sqrt(d_k) keeps the softmax from saturating and its gradient alive",
    ),
    "long-range": (
        "qkv.experiments.long_range",
        "RNNs forget distant tokens (vanishing gradients); attention reaches them in one step",
    ),
    "scaling": (
        "qkv.experiments.scaling",
        "attention costs O(n^2 d) in parallel; an RNN costs O(n d^2) in n sequential steps",
    ),
    "permutation": (
        "qkv.experiments.permutation",
        "attention is permutation-equivariant; order comes only from positional encodings",
    ),
    "vit-digits": (
        "qkv.experiments.vit_digits",
        "images as sequences of patch tokens: a tiny Vision Transformer on 8x8 digits",
    ),
    "positions-extrapolation": (
        "qkv.experiments.positions_extrapolation",
        "past the trained length ALiBi keeps a relative rule to 4x, rotary to about 2x; "
        "learned and sinusoidal positions lose it",
    ),
    "gqa-memory-quality": (
        "qkv.experiments.gqa_memory_quality",
        "grouped-query attention divides the KV cache by h / h_kv for a small loss in quality",
    ),
    "window-recall": (
        "qkv.experiments.window_recall",
        "a sliding window cannot recall beyond W - 1 tokens per layer; stacked windows or one full layer reach further",
    ),
}


def get_experiment(name: str) -> Callable[..., ExperimentResult]:
    """The ``run`` function of experiment ``name``."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name][0]).run


def run_experiment(name: str, **kwargs: Any) -> ExperimentResult:
    """Run experiment ``name`` (keyword arguments as its module's ``run``)."""
    return get_experiment(name)(**kwargs)


__all__ = ["EXPERIMENTS", "ExperimentResult", "get_experiment", "run_experiment"]
