"""The training loss: label-smoothed cross-entropy, plain (from logits) and fused with the output
projection (from the decoder's hidden states).

Shape legend: ``n`` target positions, ``d`` model width, ``V`` vocabulary size.

With smoothing ``eps`` the target distribution is ``q = (1 - eps) * onehot(y) + eps / V`` and the
loss of one position is ``-sum_c q_c log softmax(z)_c = logsumexp(z) - (1 - eps) z_y - eps/V sum_c z_c``
(Szegedy et al. 2016; "Attention Is All You Need", section 5.4, uses eps = 0.1).

A model's ``loss`` is this label-smoothed cross-entropy; objectives that add to it are the training
layer's (:mod:`qkv.training.objectives`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.runtime.padded_linear import pad_rows, padded_rows, pads_rows

# rows of logits made at once by the fused loss: (512, 8000) is 16 MiB in fp32, 8 in bf16. 1,024-row chunks
# were slower: forward + backward of 1,900 rows, bf16, 2 threads of a Zen 5 EPYC, 48-65 ms against 64-82 ms
# (when the loss still made fp32 copies of 32 MiB, above glibc's largest mmap threshold); on an AMX Xeon
# (2026-11-27, one profile, today's loss) the products of 1,024 rows took ~4x those of 512
FUSED_CHUNK_ROWS = 512


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float, ignore_index: int) -> Tensor:
    """Summed label-smoothed cross-entropy over the positions whose target is not ``ignore_index``.

    The reference the fused loss is tested against (it is PyTorch's ``F.cross_entropy``).
    Shapes: ``logits (..., V)``, ``target (...)`` -> scalar.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        target.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction="sum",
    )


# torch.compiler.disable, made at the first call: the decorator itself imports torch._dynamo, which took 2.6 of
# the 6.5 s that every qkv command (--help included) spent starting on the 2-core EPYC. PyTorch's own lazy
# form, where this build has it (private; tests/test_fast_paths.py checks a compiled loss still breaks here).
# The fused losses' decorator (the training layer's too).
compile_disabled: Any = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


@compile_disabled  # its own fused loop; traced, the row selection's shape would recompile per batch
def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    smoothing: float,
    ignore_index: int,
    *,
    chunk_rows: int = FUSED_CHUNK_ROWS,
) -> Tensor:
    """``label_smoothed_cross_entropy(hidden @ weight.T, target, ...)`` without the logits tensor.

    Only the positions with a real target are projected, a chunk of rows at a time, and the
    gradients of the loss with respect to ``hidden`` and ``weight`` are formed in the same pass (the
    loss is the last op of a training step, so they are needed anyway): the ``(n, V)`` logits, their
    log-softmax and its backward are never stored. Same value and gradients as the reference to
    float32 rounding; the saved gradients are scaled by the incoming gradient in the backward.

    Args:
        hidden: ``(..., d)`` the decoder's final hidden states.
        weight: ``(V, d)`` the output projection (tied to the target embedding or not).
        target: ``(...)`` next-token ids.
        smoothing: label smoothing ``eps`` in [0, 1).
        ignore_index: target id that adds nothing (padding).
        chunk_rows: positions projected at once.

    Returns:
        The summed loss, a scalar.
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree on positions")
    keep = (target != ignore_index).reshape(-1)
    rows = hidden.reshape(-1, hidden.size(-1))[keep]  # (n, d): real positions only
    return _LinearCrossEntropy.apply(rows, weight, target.reshape(-1)[keep], float(smoothing), int(chunk_rows))


def padded_chunks(
    rows: tuple[Tensor, ...], target: Tensor, chunk_rows: int
) -> Iterator[tuple[int, int, list[Tensor], Tensor]]:
    """``(start, real, row chunks, target chunk)`` over ``chunk_rows`` positions at a time, each chunk
    padded to few shapes (qkv.runtime.padded_linear) when the product would run in bf16 on CPU: the padding's rows are
    zero (nothing added to the weight's gradient), its targets 0, and the caller keeps the first ``real``
    rows of the loss and of the input's gradient."""
    pads = pads_rows(rows[0], rows[0].size(0))
    for start in range(0, rows[0].size(0), chunk_rows):
        parts, y = [r[start : start + chunk_rows] for r in rows], target[start : start + chunk_rows]
        real = y.size(0)
        if pads:
            padded = padded_rows(real)
            parts, y = [pad_rows(part, padded) for part in parts], F.pad(y, (0, padded - real))
        yield start, real, parts, y


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed smoothed cross-entropy of ``rows @ weight.T``; gradients made in the forward pass."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, target: Tensor, eps: float, chunk_rows: int) -> Tensor:
        device_type = rows.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else rows.dtype
        with torch.autocast(device_type, enabled=False):
            acc = torch.promote_types(dtype, torch.float32)  # what sums and gradients are kept in
            h, w = rows.to(dtype), weight.to(dtype)
            w_mean = w.to(acc).mean(dim=0)  # (d,): mean_c z_c = h . w_mean
            need_grads = rows.requires_grad or weight.requires_grad
            grad_rows = torch.empty_like(rows) if need_grads else None
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grads else None
            rows_sum = torch.zeros(w.size(1), dtype=acc, device=rows.device)
            total = torch.zeros((), dtype=acc, device=rows.device)
            for start, real, (h_c,), y_c in padded_chunks((h,), target, chunk_rows):
                # The (c, V) logits are read once, by softmax (computed in float32 inside PyTorch's
                # kernel, stored in the logits' dtype), and never converted. With p = softmax(z),
                # log-sum-exp = z_y - log p_y; the rare rows whose p_y is below the dtype's smallest
                # normal number (its log would lose precision: 1e-38 in bf16, 6e-5 in fp16) take
                # their log-sum-exp from the logits. Then
                # loss = lse - (1 - eps) z_y - eps mean_c z_c.
                z = h_c @ w.T
                probs = torch.softmax(z, dim=-1)
                h_acc = h_c.to(acc)
                z_true = z.gather(-1, y_c[:, None]).to(acc)
                p_true = probs.gather(-1, y_c[:, None]).to(acc)
                lse = z_true - p_true.log()
                tiny = (p_true < torch.finfo(probs.dtype).tiny).squeeze(1)
                if tiny.any():
                    lse[tiny] = torch.logsumexp(z[tiny].to(acc), dim=-1, keepdim=True)
                loss = lse - (1.0 - eps) * z_true
                if eps:
                    loss -= eps * (h_acc @ w_mean)[:, None]
                total += loss[:real].sum()
                if grad_rows is None or grad_weight is None:  # no gradient needed
                    continue
                # dloss/dz = probs - (1 - eps) onehot(y) - eps/V: the one-hot term goes into the
                # probabilities (one element a row: deterministic on CUDA too; written by indexing, as
                # scatter_ into bf16 is ~300x slower on CPU), the uniform term is added to the (c, d)
                # and (V, d) products
                grad_z = probs
                grad_z[torch.arange(y_c.size(0), device=y_c.device), y_c] = (p_true[:, 0] - (1.0 - eps)).to(dtype)
                grad_h = (grad_z @ w).to(acc)
                if eps:
                    grad_h.sub_(w_mean, alpha=eps)
                    rows_sum += h_acc.sum(dim=0)
                grad_rows[start : start + real] = grad_h[:real]
                grad_weight.add_(grad_z.T @ h_c)  # bf16 products summed in float32, no copy between
            if grad_weight is not None and eps:
                grad_weight -= (eps / w.size(0)) * rows_sum
        ctx.save_for_backward(grad_rows, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_rows, grad_weight = ctx.saved_tensors
        if grad_rows is None:
            raise RuntimeError("fused_linear_cross_entropy: backward called but no input required a gradient")
        g = grad_output.to(grad_weight.dtype)
        return (grad_rows * g.to(grad_rows.dtype), (grad_weight * g).to(ctx.weight_dtype), None, None, None)
