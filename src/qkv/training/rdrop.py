"""R-Drop's loss (Liang et al. 2021), the objective :class:`qkv.training.objectives.RDrop` computes.

R-Drop runs each batch twice, with different dropout, and adds ``alpha`` times the symmetric KL
divergence of the two predictions to their mean loss; per position
``(CE_a + CE_b) / 2 + alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a)) / 2`` (the paper's
``CE_a + CE_b + alpha * KL_sym`` halved, so the loss stays on one copy's scale). ``CE`` is the
label-smoothed cross-entropy of :mod:`qkv.nn.loss`.

:func:`rdrop_cross_entropy` is the reference on logits (PyTorch's ``F.cross_entropy`` and
``F.kl_div``); :func:`fused_linear_rdrop_cross_entropy` the same from the two passes' hidden states and
the output projection, never holding the ``(n, V)`` logits (as
:func:`qkv.nn.loss.fused_linear_cross_entropy` does for one pass).

Shape legend: ``n`` target positions, ``d`` model width, ``V`` vocabulary size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.loss import FUSED_CHUNK_ROWS, compile_disabled, padded_chunks


def rdrop_cross_entropy(
    logits_a: Tensor, logits_b: Tensor, target: Tensor, smoothing: float, ignore_index: int, alpha: float
) -> Tensor:
    """Summed R-Drop loss of two predictions of the same targets (see the module's docstring), over
    the positions whose target is not ``ignore_index``: PyTorch's ``F.cross_entropy`` and
    ``F.kl_div`` on the logits. The reference the fused version is tested against, and the path for
    vocabularies no larger than the model's width.

    Shapes: ``logits_a, logits_b (..., V)``, ``target (...)`` -> scalar.
    """
    real = target != ignore_index
    dtype = torch.promote_types(logits_a.dtype, torch.float32)  # float32 at least (float64 stays)
    a, b, y = logits_a[real].to(dtype), logits_b[real].to(dtype), target[real]
    cross_entropy = F.cross_entropy(a, y, label_smoothing=smoothing, reduction="sum") + F.cross_entropy(
        b, y, label_smoothing=smoothing, reduction="sum"
    )
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    # F.kl_div(input, target) is KL(target || input)
    kl = F.kl_div(log_b, log_a, reduction="sum", log_target=True) + F.kl_div(
        log_a, log_b, reduction="sum", log_target=True
    )
    return 0.5 * cross_entropy + 0.25 * alpha * kl


@compile_disabled  # as the fused loss: traced, its row selection would recompile per batch
def fused_linear_rdrop_cross_entropy(
    hidden_a: Tensor,
    hidden_b: Tensor,
    weight: Tensor,
    target: Tensor,
    smoothing: float,
    ignore_index: int,
    alpha: float,
    *,
    chunk_rows: int = FUSED_CHUNK_ROWS,
) -> Tensor:
    """``rdrop_cross_entropy(hidden_a @ weight.T, hidden_b @ weight.T, target, ...)`` without the
    logits tensors, as :func:`fused_linear_cross_entropy` does for one prediction: the real positions
    of both copies projected a chunk of rows at a time, the gradients formed in the same pass.

    Args:
        hidden_a, hidden_b: ``(..., d)`` the final hidden states of the two passes.
        weight: ``(V, d)`` the output projection.
        target: ``(...)`` next-token ids (the same for both passes).
        smoothing: label smoothing ``eps`` in [0, 1).
        ignore_index: target id that adds nothing (padding).
        alpha: the weight of the symmetric KL divergence.
        chunk_rows: positions projected at once.

    Returns:
        The summed loss, a scalar.
    """
    if hidden_a.shape != hidden_b.shape or hidden_a.shape[:-1] != target.shape:
        raise ValueError(
            f"hidden {tuple(hidden_a.shape)}, {tuple(hidden_b.shape)} and target {tuple(target.shape)} "
            "disagree on positions"
        )
    keep = (target != ignore_index).reshape(-1)
    rows_a = hidden_a.reshape(-1, hidden_a.size(-1))[keep]
    rows_b = hidden_b.reshape(-1, hidden_b.size(-1))[keep]
    return _LinearRDrop.apply(
        rows_a, rows_b, weight, target.reshape(-1)[keep], float(smoothing), float(alpha), int(chunk_rows)
    )


class _LinearRDrop(torch.autograd.Function):
    """Summed R-Drop loss of ``rows_a @ weight.T`` and ``rows_b @ weight.T``; gradients made in the
    forward pass. With ``d = log p_a - log p_b`` and smoothed targets ``q``, the gradients of a
    position's loss with respect to the two logit rows are
    ``(p_a - q) / 2 + alpha / 4 * (p_a * (d - KL(p_a || p_b)) + p_a - p_b)`` and
    ``(p_b - q) / 2 + alpha / 4 * (p_b * (-d - KL(p_b || p_a)) + p_b - p_a)``."""

    @staticmethod
    def forward(
        ctx: Any,
        rows_a: Tensor,
        rows_b: Tensor,
        weight: Tensor,
        target: Tensor,
        eps: float,
        alpha: float,
        chunk_rows: int,
    ) -> Tensor:
        device_type = rows_a.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else rows_a.dtype
        with torch.autocast(device_type, enabled=False):
            h_a, h_b, w = rows_a.to(dtype), rows_b.to(dtype), weight.to(dtype)
            vocab = w.size(0)
            need_grads = rows_a.requires_grad or rows_b.requires_grad or weight.requires_grad
            grad_a = torch.empty_like(rows_a) if need_grads else None
            grad_b = torch.empty_like(rows_b) if need_grads else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
            total = torch.zeros((), dtype=torch.float32, device=rows_a.device)
            for start, real, (ha_c, hb_c), y_c in padded_chunks((h_a, h_b), target, chunk_rows):
                log_a = (ha_c @ w.T).float().log_softmax(-1)  # (c, V)
                log_b = (hb_c @ w.T).float().log_softmax(-1)
                cross_entropy = -(1.0 - eps) * (log_a.gather(-1, y_c[:, None]) + log_b.gather(-1, y_c[:, None]))
                if eps:
                    cross_entropy -= (eps / vocab) * (log_a.sum(-1, keepdim=True) + log_b.sum(-1, keepdim=True))
                p_a, p_b = log_a.exp(), log_b.exp()
                diff = log_a.sub_(log_b)  # log p_a - log p_b (log_a is not needed again)
                del log_b
                kl_ab = (p_a * diff).sum(-1, keepdim=True)
                kl_ba = -(p_b * diff).sum(-1, keepdim=True)
                loss = 0.5 * cross_entropy + 0.25 * alpha * (kl_ab + kl_ba)
                total += loss[:real].sum()
                if grad_a is None or grad_b is None or grad_weight is None:  # no gradient needed
                    continue
                grad_za = (diff - kl_ab).mul_(p_a).add_(p_a).sub_(p_b).mul_(0.25 * alpha).add_(p_a, alpha=0.5)
                grad_zb = diff.add_(kl_ba).neg_().mul_(p_b).add_(p_b).sub_(p_a).mul_(0.25 * alpha)
                grad_zb.add_(p_b, alpha=0.5)
                for g in (grad_za, grad_zb):  # minus half the smoothed target
                    if eps:
                        g.sub_(0.5 * eps / vocab)
                    g.scatter_add_(-1, y_c[:, None], g.new_full((y_c.size(0), 1), -0.5 * (1.0 - eps)))
                grad_za, grad_zb = grad_za.to(dtype), grad_zb.to(dtype)
                grad_a[start : start + real] = (grad_za @ w)[:real]
                grad_b[start : start + real] = (grad_zb @ w)[:real]
                grad_weight += (grad_za.T @ ha_c).float() + (grad_zb.T @ hb_c).float()
        ctx.save_for_backward(grad_a, grad_b, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_a, grad_b, grad_weight = ctx.saved_tensors
        if grad_a is None:
            raise RuntimeError("fused_linear_rdrop_cross_entropy: backward called but no input required a gradient")
        g = grad_output.float()
        return (
            grad_a * g.to(grad_a.dtype),
            grad_b * g.to(grad_b.dtype),
            (grad_weight * g).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )
