"""Multi-head attention for inference over rows, with its projections given as products.

:class:`~qkv.attention.multihead.MultiHeadAttention` is the module a model trains and runs with: 3-D
inputs, masks of every kind, weights on request, dropout. Decoding needs less of it, many times a
sentence: the same attention (section 3.2.2), computed here for 2-D rows with

* the projections given as *products*, callables ``(n, i) -> (n, o)``: the module's own
  ``nn.Linear`` weights through ``F.linear``, or packed and fused ones
  (:mod:`qkv.decoding.packed_linear`), so that the self-attention's q/k/v are one product and the
  cross-attention's k/v another;
* the source padding as a float addend of the scores, built once per sentence batch
  (:func:`padding_addend`), since attention would build it from a boolean mask on every call;
* a sentence's memory kept once for its beams: ``g`` consecutive rows that read one memory row are
  its ``g`` queries (:class:`MemoryAttention`), so the memory's keys and values are never copied
  ``g`` times.

The kernel is PyTorch's fused ``scaled_dot_product_attention``, or the eager reference
(:func:`qkv.attention.functional.attention_reference`) inside ``use_backend("reference")``; tests
(tests/test_inference_model.py) hold both to ``MultiHeadAttention``'s output through the model's
own ``encode`` / ``decode``.

Shape legend: ``b`` rows (sentences, times the beam), ``m`` memory rows kept, ``g`` rows a memory row
serves, ``s`` self length (``t`` decoded so far), ``s_m`` memory length, ``e`` embed_dim, ``h``
heads, ``d_h`` head size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import backends
from qkv.attention.functional import attention_reference

Product = Callable[[Tensor], Tensor]  # a linear map on rows: (n, i) -> (n, o)


def padding_addend(real: Tensor) -> Tensor:
    """``real (b, s_m)``, True at a real token -> ``(b, 1, 1, s_m)`` float32 added to the scores: 0 at
    a real token, -inf at padding (the mask convention's float form)."""
    return torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_fill_(~real, float("-inf"))[
        :, None, None, :
    ]


def _attend(q: Tensor, k: Tensor, v: Tensor, addend: Tensor | None) -> Tensor:
    """``softmax(q k^T / sqrt(d_h) + addend) v``: ``q (..., s_q, d_h)``, ``k, v (..., s_k, d_h)``."""
    if backends.forced_backend() == "reference":
        return attention_reference(q, k, v, addend)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=addend)


def self_attention(qkv: Product, out: Product, x: Tensor, b: int, s: int, heads: int, addend: Tensor | None) -> Tensor:
    """Unmasked self-attention of whole sequences (the encoder's), from rows.

    Args:
        qkv: the fused q/k/v product, ``(n, e) -> (n, 3e)``.
        out: the output product, ``(n, e) -> (n, e)``.
        x: ``(b * s, e)`` the sequences' positions as rows.
        b: sequences. s: positions each.
        heads: ``h``.
        addend: ``(b, 1, 1, s)`` added to the scores (:func:`padding_addend`), or None.

    Returns:
        ``(b * s, e)``.
    """
    e = x.size(-1)
    q, k, v = qkv(x).view(b, s, 3, heads, e // heads).permute(2, 0, 3, 1, 4).unbind(0)  # (b, h, s, d_h) each
    attended = _attend(q, k, v, addend)  # (b, h, s, d_h)
    return out(attended.transpose(1, 2).reshape(b * s, e))


class CachedSelfAttention:
    """Masked self-attention one new position at a time, keeping the keys and values so far.

    Args:
        qkv: the fused q/k/v product, ``(b, e) -> (b, 3e)``.
        out: the output product.
        heads: ``h``.
    """

    def __init__(self, qkv: Product, out: Product, heads: int) -> None:
        self.qkv, self.out, self.heads = qkv, out, heads
        self.key: Tensor | None = None  # (b, h, t, d_h)
        self.value: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        """``x (b, e)``, the new position of every row -> ``(b, e)``; it sees every key so far and its own
        (the causal mask's last row)."""
        b, e = x.shape
        q, k, v = self.qkv(x).view(b, 3, self.heads, 1, e // self.heads).unbind(1)  # (b, h, 1, d_h) each
        if self.key is not None and self.value is not None:
            k, v = torch.cat([self.key, k], dim=2), torch.cat([self.value, v], dim=2)  # (b, h, t, d_h)
        self.key, self.value = k, v
        return self.out(_attend(q, k, v, None).view(b, e))

    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` (in that order, repeats allowed)."""
        if self.key is not None and self.value is not None:
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)


class MemoryAttention:
    """Cross-attention of rows to the encoder's memory, its keys and values projected once.

    Args:
        q: the query product. kv: the fused key/value product, ``(n, e) -> (n, 2e)``. out: the output product.
        heads: ``h``.
        memory: ``(m, s_m, e)`` the encoder's output.
        addend: ``(m, 1, 1, s_m)`` the memory's padding (:func:`padding_addend`).
    """

    def __init__(self, q: Product, kv: Product, out: Product, heads: int, memory: Tensor, addend: Tensor) -> None:
        m, s, e = memory.shape
        self.q, self.out, self.heads = q, out, heads
        kv_rows = kv(memory.reshape(m * s, e))  # (m * s_m, 2e)
        self.key, self.value = kv_rows.view(m, s, 2, heads, e // heads).permute(2, 0, 3, 1, 4).unbind(0)
        self.addend = addend  # (m, 1, 1, s_m)

    @property
    def rows(self) -> int:
        """``m``, the memory rows kept."""
        return self.key.size(0)

    def __call__(self, x: Tensor) -> Tensor:
        """``x (b, e)`` -> ``(b, e)``, where ``b`` is ``g * m``: rows ``i*g ... i*g + g - 1`` read memory row ``i``."""
        b, e = x.shape
        m, d_h = self.rows, e // self.heads
        if b == m:  # a memory row per row
            q = self.q(x).view(b, self.heads, 1, d_h)
            return self.out(_attend(q, self.key, self.value, self.addend).view(b, e))
        # g = b / m consecutive rows (a sentence's beams) share a memory row: they are its g queries
        q = self.q(x).view(m, b // m, self.heads, d_h).transpose(1, 2)  # (m, h, g, d_h)
        attended = _attend(q, self.key, self.value, self.addend)  # (m, h, g, d_h)
        return self.out(attended.transpose(1, 2).reshape(b, e))

    def select(self, index: Tensor) -> None:
        """Keep the memory rows ``index`` (in that order, repeats allowed)."""
        self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
        self.addend = self.addend.index_select(0, index)
