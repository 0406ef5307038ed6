"""The training loss: label-smoothed cross-entropy, plain (from logits) and fused with the output
projection (from the decoder's hidden states).

Shape legend: ``n`` target positions, ``d`` model width, ``V`` vocabulary size.

With smoothing ``eps`` the target distribution is ``q = (1 - eps) * onehot(y) + eps / V`` and the
loss of one position is ``-sum_c q_c log softmax(z)_c = logsumexp(z) - (1 - eps) z_y - eps/V sum_c z_c``
(Szegedy et al. 2016; "Attention Is All You Need", section 5.4, uses eps = 0.1).

R-Drop (Liang et al. 2021) runs each batch twice, with different dropout, and adds ``alpha`` times
the symmetric KL divergence of the two predictions to their mean loss; per position
``(CE_a + CE_b) / 2 + alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a)) / 2`` (the paper's
``CE_a + CE_b + alpha * KL_sym`` halved, so the loss stays on one copy's scale).
"""

from __future__ import annotations

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


@torch.compiler.disable  # its own fused loop; traced, the row selection's shape would recompile per batch
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


def _padded_chunks(rows: tuple[Tensor, ...], target: Tensor, chunk_rows: int):
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
    def forward(ctx, rows: Tensor, weight: Tensor, target: Tensor, eps: float, chunk_rows: int) -> Tensor:
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
            for start, real, (h_c,), y_c in _padded_chunks((h,), target, chunk_rows):
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
                if not need_grads:
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
            if need_grads and eps:
                grad_weight -= (eps / w.size(0)) * rows_sum
        ctx.save_for_backward(grad_rows, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_rows, grad_weight = ctx.saved_tensors
        if grad_rows is None:
            raise RuntimeError("fused_linear_cross_entropy: backward called but no input required a gradient")
        g = grad_output.to(grad_weight.dtype)
        return (grad_rows * g.to(grad_rows.dtype), (grad_weight * g).to(ctx.weight_dtype), None, None, None)


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


@torch.compiler.disable
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
        ctx, rows_a: Tensor, rows_b: Tensor, weight: Tensor, target: Tensor, eps: float, alpha: float, chunk_rows: int
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
            for start, real, (ha_c, hb_c), y_c in _padded_chunks((h_a, h_b), target, chunk_rows):
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
                if not need_grads:
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
    def backward(ctx, grad_output: Tensor):
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
