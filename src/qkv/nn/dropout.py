"""Dropout (Srivastava et al. 2014) with a faster mask on CPU.

``F.dropout`` on CPU draws its mask with ``bernoulli_``, one 32-bit draw and a float compare per
element: a tenth of a Multi30k training step on a 2-core CPU. Here one 64-bit draw from PyTorch's
generator gives four 16-bit uniforms, and an element is dropped when its uniform falls below
``round(p * 2^16)``; kept elements are scaled by ``1 / (1 - p')`` with ``p' = round(p * 2^16) / 2^16``
(``|p - p'| <= 2^-17``), so the expected output still equals the input exactly. Forward plus
backward take about 2.5x less time than ``F.dropout`` on a (5900, 256) float32 tensor. Other
devices, and code being compiled by ``torch.compile``, use ``F.dropout``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LEVELS = 1 << 16  # a 16-bit uniform draw per element


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element of ``x`` with probability ``p`` and scale the rest so the mean is kept.

    Args:
        x: any shape, floating point.
        p: drop probability in [0, 1].
        training: identity when False.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    threshold = round(p * _LEVELS)
    if x.device.type != "cpu" or threshold >= _LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)
    draws = words.view(torch.int16)[:n].view(x.shape)  # uniform over [-2^15, 2^15)
    keep = (draws >= threshold - _LEVELS // 2).to(x.dtype).mul_(_LEVELS / (_LEVELS - threshold))
    return x * keep  # the backward multiplies the gradient by the same scaled mask


class Dropout(nn.Module):
    """Drop-in for ``nn.Dropout`` that runs :func:`dropout`."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        """:func:`dropout` of ``x`` at this module's ``p``, in training mode only (identity in eval).

        Args:
            x: any shape, floating point.

        Returns:
            ``x``'s shape.
        """
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        """``p=...``, shown in the module's repr as ``nn.Dropout`` shows it."""
        return f"p={self.p}"


@contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Run the block with every dropout of ``model`` at 0: :class:`Dropout` and ``nn.Dropout`` modules,
    and the attention-weight dropout of modules that keep it as a float ``dropout`` attribute
    (:class:`~qkv.attention.multihead.MultiHeadAttention`). The rates are put back afterwards, also
    when the block raises. Used for late dropout (``--dropout-start``): the first steps of a run
    learn faster and cheaper without it (Liu et al. 2023, "Dropout Reduces Underfitting")."""
    saved: list[tuple[nn.Module, str, float]] = []
    for module in model.modules():
        if isinstance(module, (Dropout, nn.Dropout)) and module.p:
            saved.append((module, "p", module.p))
        elif isinstance(rate := getattr(module, "dropout", None), float) and rate:
            saved.append((module, "dropout", rate))
    try:
        for module, name, _ in saved:
            setattr(module, name, 0.0)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
