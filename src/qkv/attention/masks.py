"""Mask helpers. One convention everywhere: boolean ``True`` means "may attend" / "is a real token".

A float mask is additive: it is added to the attention scores (``0`` keeps, ``-inf`` removes).

Shape legend: ``b`` batch, ``h`` heads, ``s_q`` query length, ``s_k`` key length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(s_q: int, s_k: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Boolean causal mask aligned bottom-right: the last query sees every key.

    Query ``i`` may attend to key ``j`` when ``j <= i + (s_k - s_q)``. With ``s_q == s_k`` this is
    the usual lower triangle. With ``s_q < s_k`` (cached decoding: ``s_k - s_q`` keys came earlier)
    the new queries see all past keys::

        s_q = 2, s_k = 5        s_q = 5, s_k = 2
        1 1 1 1 0               0 0
        1 1 1 1 1               0 0
                                0 0
                                1 0
                                1 1

    With ``s_q > s_k`` the first ``s_q - s_k`` rows see nothing; attention returns zeros there.

    Args:
        s_q: number of queries.
        s_k: number of keys (defaults to ``s_q``).
        device: where to build the mask.

    Returns:
        Bool tensor of shape ``(s_q, s_k)``.
    """
    s_k = s_q if s_k is None else s_k
    if s_q < 0 or s_k < 0:
        raise ValueError(f"causal_mask needs non-negative lengths, got s_q={s_q}, s_k={s_k}")
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(diagonal=s_k - s_q)


def sliding_window_mask(
    s_q: int, s_k: int | None = None, window: int = 1, *, device: torch.device | str | None = None
) -> Tensor:
    """Boolean causal mask with a sliding window, aligned bottom-right as :func:`causal_mask`: query
    ``i`` (at key position ``i + s_k - s_q``) sees itself and the ``window - 1`` keys before it.

    Args:
        s_q: number of queries. s_k: number of keys (defaults to ``s_q``).
        window: keys each query sees, itself included (at least 1).
        device: where to build the mask.

    Returns:
        Bool tensor ``(s_q, s_k)``; with ``window >= s_k`` it is :func:`causal_mask`.
    """
    s_k = s_q if s_k is None else s_k
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    causal = causal_mask(s_q, s_k, device=device)
    return causal & ~torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(diagonal=s_k - s_q - window)


def padding_mask_from_lengths(lengths: Tensor | list[int], max_len: int | None = None) -> Tensor:
    """Key padding mask from sequence lengths: ``True`` marks a real token.

    Args:
        lengths: ``(b,)`` integer lengths.
        max_len: padded length (defaults to ``max(lengths)``).

    Returns:
        Bool tensor ``(b, max_len)``.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (b,), got shape {tuple(lengths.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    max_len = longest if max_len is None else max_len
    if longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def padding_mask_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """Key padding mask from token ids: ``True`` wherever ``ids != pad_id``. Shape ``(b, s)``."""
    return ids != pad_id


def as_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A boolean mask as an additive float mask: ``0`` where True, ``-inf`` where False."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


def broadcast_shape(*shapes: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or None when they do not broadcast.

    Pure Python: ``torch.broadcast_shapes`` builds tensors and costs ~20 us a call, more than a
    small fused attention kernel, and masks are checked on every attention call.
    """
    ndim = 0
    for shape in shapes:
        ndim = len(shape) if len(shape) > ndim else ndim
    out = [1] * ndim
    for shape in shapes:
        offset = ndim - len(shape)
        for i, size in enumerate(shape):
            current = out[offset + i]
            if size == current or size == 1:
                continue
            if current != 1:
                return None
            out[offset + i] = size
    return tuple(out)


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Combine masks that apply together; ``None`` entries are skipped.

    Boolean masks are combined with logical AND (a key is kept only if every mask keeps it).
    If any mask is a float (additive) mask, the result is additive: booleans become ``0/-inf``
    and all masks are summed. The result broadcasts the inputs' shapes.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    if len(present) > 1 and broadcast_shape(*(m.shape for m in present)) is None:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"masks of shapes {shapes} do not broadcast together")
    if all(m.dtype == torch.bool for m in present):
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    float_dtype = next(m.dtype for m in present if m.dtype != torch.bool)
    out = as_additive(present[0], float_dtype)
    for m in present[1:]:
        out = out + as_additive(m, float_dtype)
    return out
