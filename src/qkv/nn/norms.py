"""The layer norms a model may use: LayerNorm (the paper's, section 3.1) and RMSNorm.

RMSNorm (Zhang and Sennrich 2019, "Root Mean Square Layer Normalization") drops LayerNorm's centring
and bias: ``y = x / sqrt(mean(x^2) + eps) * weight``, as in Llama, Qwen and Gemma-style models.

Shape legend: ``d`` the normalized width (d_model, or head_dim for a per-head norm).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

NORMS = ("layer", "rms")  # the kinds build_norm makes


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension.

    The statistics and the scaling run in float32 for a half-precision ``x`` (in float64 for a float64
    one); the normalized values are cast back to ``x``'s dtype before the weight multiplies them, so a
    float32 or bfloat16 model computes what a Hugging Face Llama's norm computes, rounding included.
    """

    def __init__(self, d: int, *, eps: float = 1e-6) -> None:
        """Args:
        d: the width normalized (the last dimension of the input).
        eps: added to the mean square before the square root.
        """
        super().__init__()
        if d < 1:
            raise ValueError(f"d must be positive, got {d}")
        if eps < 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalize ``x`` over its last dimension.

        Args:
            x: ``(..., d)``.

        Returns:
            ``(..., d)``, of the dtype ``weight * x`` promotes to (``x``'s when the weight has it).
        """
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)  # (..., d) float32 or float64
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        """The width and eps, for ``print(model)``."""
        return f"{self.weight.size(0)}, eps={self.eps}"


def build_norm(kind: str, d: int, eps: float) -> nn.Module:
    """The norm of one kind over a width.

    Args:
        kind: ``"layer"`` (:class:`torch.nn.LayerNorm`, with weight and bias) or ``"rms"`` (:class:`RMSNorm`).
        d: the width normalized.
        eps: the norm's epsilon.

    Returns:
        The module, ``(..., d) -> (..., d)``.
    """
    if kind == "layer":
        return nn.LayerNorm(d, eps=eps)
    if kind == "rms":
        return RMSNorm(d, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose one of {list(NORMS)}")
