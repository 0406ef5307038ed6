"""ALiBi (Press et al. 2022, "Train Short, Test Long"): attention biased by distance instead of positions.

Head ``j`` adds ``-m_j * (i - k)`` to the score of query position ``i`` for key position ``k <= i``, with
slopes ``m_j`` a geometric sequence fixed per head count: for ``n`` a power of two, ``m_j = 2^(-8j/n)``,
``j = 1..n``. For another ``n`` the paper takes the slopes of the power of two ``p`` just below ``n``, then
fills the remaining ``n - p`` heads with every other slope of ``2p`` heads (its 1st, 3rd, 5th, ...), the
slopes that fall between those of ``p`` heads.

Shape legend: ``h`` heads, ``s_q`` queries, ``s_k`` keys.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _power_of_two_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * j / n) for j in range(1, n + 1)]


def alibi_slopes(num_heads: int) -> Tensor:
    """The slope of each head (see the module's docstring).

    Args:
        num_heads: the number of heads, at least 1.

    Returns:
        ``(h,)`` float32, from the steepest (head 0) to the flattest.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    below = 2 ** int(math.floor(math.log2(num_heads)))  # the largest power of two <= num_heads
    slopes = _power_of_two_slopes(below)
    slopes += _power_of_two_slopes(2 * below)[0::2][: num_heads - below]  # empty when num_heads is a power of two
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, s_q: int, s_k: int, offset: int = 0) -> Tensor:
    """The bias added to each head's attention scores.

    Query ``i`` sits at position ``offset + i`` and key ``k`` at position ``k``; a key at or before the
    query gets ``-slope * (offset + i - k)`` (0 on the diagonal), a later key 0 (masking it is the causal
    mask's work). With a cache holding ``s_k - s_q`` earlier keys, ``offset = s_k - s_q``.

    Args:
        slopes: ``(h,)``, from :func:`alibi_slopes`.
        s_q: the number of queries.
        s_k: the number of keys.
        offset: the position of the first query.

    Returns:
        ``(h, s_q, s_k)`` of ``slopes``' dtype and device.
    """
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be (h,), got shape {tuple(slopes.shape)}")
    if s_q < 0 or s_k < 0 or offset < 0:
        raise ValueError(f"s_q, s_k and offset must be non-negative, got {s_q}, {s_k}, {offset}")
    queries = torch.arange(offset, offset + s_q, device=slopes.device)[:, None]  # (s_q, 1)
    keys = torch.arange(s_k, device=slopes.device)[None, :]  # (1, s_k)
    distance = (queries - keys).clamp(min=0).to(slopes.dtype)  # (s_q, s_k): 0 for the query's own and later keys
    return -slopes[:, None, None] * distance  # (h, s_q, s_k)
