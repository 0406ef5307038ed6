"""Scaled dot-product attention: the readable reference (the spec) and the public entry point.

Shape legend: ``...`` leading batch dims (usually ``b, h``), ``s_q`` queries, ``s_k`` keys,
``d`` query/key feature size, ``d_v`` value feature size.

Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V      ("Attention Is All You Need", section 3.2.1)
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import backends
from qkv.attention.masks import broadcast_shape, causal_mask


@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: Literal[False] = False,
    enable_gqa: bool = False,
) -> Tensor: ...


@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    *,
    need_weights: Literal[True],
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]: ...


@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    enable_gqa: bool = False,
) -> Tensor | tuple[Tensor, Tensor]: ...


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    enable_gqa: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention with safe masking.

    Runs PyTorch's fused kernel when the attention weights are not needed and the case allows
    (see :func:`qkv.attention.backends.select_backend`); otherwise runs :func:`attention_reference`,
    which (in float32) is also the faster of the two for training on short sequences on CPU
    (:func:`qkv.attention.backends.plain_is_faster`). Both compute the same function; the tests
    hold them to 1e-5.

    Args:
        q: queries ``(..., s_q, d)``.
        k: keys ``(..., s_k, d)``.
        v: values ``(..., s_k, d_v)``.
        attn_mask: boolean (True = may attend) or float (added to the scores), broadcastable to
            ``(..., s_q, s_k)``.
        is_causal: apply a causal mask aligned bottom-right (see :func:`qkv.causal_mask`).
            Combined with ``attn_mask`` if both are given.
        dropout_p: dropout probability on the attention weights (pass 0.0 in evaluation).
        scale: factor applied to ``q k^T``; defaults to ``1 / sqrt(d)``.
        need_weights: also return the attention weights (before dropout).
        enable_gqa: grouped-query attention: ``k`` and ``v`` hold ``h_kv`` heads (dim -3), fewer than
            ``q``'s ``h``, and key/value head ``j`` serves query heads ``j * h / h_kv`` to
            ``(j + 1) * h / h_kv - 1`` (``h`` a multiple of ``h_kv``).

    Returns:
        ``out`` of shape ``(..., s_q, d_v)``, or ``(out, weights)`` with weights
        ``(..., s_q, s_k)`` when ``need_weights``. A query whose every key is masked gets a zero
        output row and zero weights, never NaN, in the forward and the backward pass.
    """
    groups = _query_groups(q, k, v) if enable_gqa else 1
    check_attention_inputs(q, k, v, attn_mask, dropout_p, kv_groups=groups)
    return attention_kernel(q, k, v, attn_mask, is_causal, dropout_p, scale, need_weights, groups)


def attention_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    need_weights: bool,
    groups: int = 1,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`scaled_dot_product_attention` without its checks, for code that built ``q``, ``k``, ``v``
    itself (:meth:`qkv.MultiHeadAttention.attend`, run every decoding step): the fused kernel, the eager
    reference or the plain products, as that function chooses.

    Args:
        q, k, v, attn_mask, is_causal, dropout_p, scale, need_weights: as :func:`scaled_dot_product_attention`'s.
        groups: query heads per key/value head (grouped-query attention); 1: as many heads.

    Returns:
        As :func:`scaled_dot_product_attention`.
    """
    if not need_weights and backends.forced_backend() != "reference":  # the fast path, decided cheaply
        if groups == 1 and backends.plain_is_faster(q, k, v):  # CPU training on short sequences: plain products win
            return backends.in_float32(_reference_output, q, k, v, attn_mask, is_causal, dropout_p, scale)
        return backends.torch_sdpa(q, k, v, attn_mask, is_causal, dropout_p, scale, groups > 1)
    if groups > 1:  # the reference reads one key/value head per query head
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    backends.select_backend(q, k, v, attn_mask, is_causal, dropout_p, need_weights)  # logs why
    out, weights = attention_reference(q, k, v, attn_mask, is_causal, dropout_p, scale)
    return (out, weights) if need_weights else out


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The eager reference: plain matmul, masked softmax, matmul. Returns ``(out, weights)``.

    Same arguments as :func:`scaled_dot_product_attention`, without validation.
    """
    s_q, s_k = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., s_q, s_k)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(s_q, s_k, device=q.device), float("-inf"))
    weights = masked_softmax(scores)  # (..., s_q, s_k)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
    return dropped @ v, weights  # (..., s_q, d_v), (..., s_q, s_k)


def _reference_output(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float, scale: float | None
) -> Tensor:
    return attention_reference(q, k, v, attn_mask, is_causal, dropout_p, scale)[0]


def masked_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim where a row of all ``-inf`` gives all zeros (not NaN).

    The fully masked rows are replaced by zeros *before* the softmax, so no NaN is ever formed
    and the backward pass through them is exactly zero. Low-precision scores are accumulated in
    float32.
    """
    fully_masked = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (..., s_q, 1)
    scores = scores.masked_fill(fully_masked, 0.0)
    compute_dtype = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores, dim=-1, dtype=compute_dtype).to(scores.dtype)
    return weights.masked_fill(fully_masked, 0.0)


def _query_groups(q: Tensor, k: Tensor, v: Tensor) -> int:
    """How many query heads each key/value head serves (grouped-query attention): ``h / h_kv``."""
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"enable_gqa needs q, k, v of shape (..., heads, seq, dim); got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    h, h_kv = q.size(-3), k.size(-3)
    if h_kv == 0 or h % h_kv != 0 or v.size(-3) != h_kv:
        raise ValueError(f"enable_gqa: q's {h} heads must be a multiple of k's and v's ({h_kv}, {v.size(-3)})")
    return h // h_kv


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float = 0.0, kv_groups: int = 1
) -> None:
    """Raise ``ValueError`` naming the offending shapes, dtypes or devices (``kv_groups``: query heads
    per key/value head, grouped-query attention).

    Runs on every attention call, so it reads each shape once and compares plain tuples (a few
    microseconds; ``torch.broadcast_shapes`` alone would cost ~20).
    """
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs):
        raise ValueError(f"q, k, v must have the same rank >= 2 (..., seq, dim); got shapes q={qs}, k={ks}, v={vs}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k must share the feature size: q={qs} has {qs[-1]}, k={ks} has {ks[-1]}")
    if ks[-2] != vs[-2]:
        raise ValueError(f"k and v must have the same number of keys: k={ks}, v={vs}")
    lead_k = ks[:-2] if kv_groups == 1 else (*ks[:-3], ks[-3] * kv_groups)
    if qs[:-2] != lead_k or ks[:-2] != vs[:-2]:
        raise ValueError(f"q, k, v must have the same leading (batch, head) dims; got q={qs}, k={ks}, v={vs}")
    dtype = q.dtype
    if not (dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: q={dtype}, k={k.dtype}, v={v.dtype}")
    if not dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {dtype}")
    device = q.device
    if not (device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: q={device}, k={k.device}, v={v.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {device}")
        target = (*qs[:-1], ks[-2])
        if broadcast_shape(attn_mask.shape, target) != target:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., s_q, s_k) = {target}"
            )
