"""The optimizer a run trains with (:class:`~qkv.training.config.TrainConfig`'s Adam options and
``weight_decay``)."""

from __future__ import annotations

from typing import Any

import torch

from qkv.training.config import TrainConfig


def make_optimizer(module: torch.nn.Module, config: TrainConfig, *, fused: bool | None) -> torch.optim.Optimizer:
    """The run's optimizer: Adam (section 5.3), or with ``config.weight_decay`` AdamW whose decay falls
    on the matrices (weights and embeddings, two dimensions or more) and not on biases or layer-norm
    gains. ``fused``: PyTorch's fused kernel (one over all parameters; 3x faster than the default
    per-tensor loop on a 2-core CPU), None for the default (FSDP2's sharded parameters)."""
    options: dict[str, Any] = dict(lr=0.0, betas=config.adam_betas, eps=config.adam_eps, fused=fused)
    if not config.weight_decay:  # one parameter group, as every run before the option (their checkpoints resume)
        return torch.optim.Adam(module.parameters(), **options)
    params = list(module.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], **options)
