"""Multi-head attention for inference over rows, with its projections given as products.

:class:`~qkv.attention.multihead.MultiHeadAttention` is the module a model trains and runs with.
Decoding runs the same attention many times a sentence, and this module runs it over the module's own
steps (:meth:`~qkv.attention.multihead.MultiHeadAttention.heads`, ``place_queries`` /
``place_keys``, :meth:`~qkv.attention.multihead.MultiHeadAttention.attend`), for 2-D rows, with

* the projections given as *products*, callables ``(n, i) -> (n, o)``: the module's own
  ``nn.Linear`` weights through ``F.linear``, or packed and fused ones
  (:mod:`qkv.decoding.packed_linear`), so that the self-attention's q/k/v are one product and the
  cross-attention's k/v another;
* the source padding as a float addend of the scores, built once per sentence batch
  (:func:`padding_addend`), since attention would build it from a boolean mask on every call;
* a sentence's memory kept once for its beams: ``g`` consecutive rows that read one memory row are
  its ``g`` queries (:class:`MemoryAttention`), so the memory's keys and values are never copied
  ``g`` times.

A variant of the attention (grouped-query heads, rotary positions, QK-norm, a window) is written in
those steps, and so it is here too. Tests (tests/test_inference_model.py) hold this to
``MultiHeadAttention``'s output through the model's own ``encode`` / ``decode``.

Shape legend: ``b`` rows (sentences, times the beam), ``m`` memory rows kept, ``g`` rows a memory row
serves, ``s`` self length (``t`` decoded so far), ``s_m`` memory length, ``e`` embed_dim, ``h``
heads, ``d_h`` head size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.multihead import KVCache, MultiHeadAttention

Product = Callable[[Tensor], Tensor]  # a linear map on rows: (n, i) -> (n, o)


def padding_addend(real: Tensor) -> Tensor:
    """``real (b, s_m)``, True at a real token -> ``(b, 1, 1, s_m)`` float32 added to the scores: 0 at
    a real token, -inf at padding (the mask convention's float form)."""
    return torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_fill_(~real, float("-inf"))[
        :, None, None, :
    ]


def self_attention(
    attention: MultiHeadAttention, qkv: Product, out: Product, x: Tensor, b: int, s: int, addend: Tensor | None
) -> Tensor:
    """Unmasked self-attention of whole sequences (the encoder's), from rows.

    Args:
        attention: the module whose steps run (its heads, norms, positions, kernel).
        qkv: its fused q/k/v product, ``(n, e) -> (n, e + 2 h_kv d_h)``.
        out: its output product, ``(n, e) -> (n, e)``.
        x: ``(b * s, e)`` the sequences' positions as rows.
        b: sequences. s: positions each.
        addend: ``(b, 1, 1, s)`` added to the scores (:func:`padding_addend`), or None.

    Returns:
        ``(b * s, e)``.
    """
    q, k, v = attention.split(qkv(x).view(b, s, -1), attention.widths)  # (b, h or h_kv, s, d_h) each
    q, k = attention.place_queries(q, 0), attention.place_keys(k, 0)
    attended = attention.attend(q, k, v, addend)[0]  # (b, s, e)
    return out(attended.view(b * s, -1))


class CachedSelfAttention:
    """Masked self-attention one new position at a time, keeping the keys and values so far.

    Args:
        attention: the module whose steps run.
        qkv: its fused q/k/v product, ``(b, e) -> (b, e + 2 h_kv d_h)``.
        out: its output product.
    """

    def __init__(self, attention: MultiHeadAttention, qkv: Product, out: Product) -> None:
        self.attention, self.qkv, self.out = attention, qkv, out
        self.cache: KVCache | None = None  # (b, h_kv, t, d_h) each

    def __call__(self, x: Tensor) -> Tensor:
        """``x (b, e)``, the new position of every row -> ``(b, e)``; it sees every key so far and its own
        (the causal mask's last row; with a window, the window's)."""
        a, b = self.attention, x.size(0)
        q, k, v = a.split(self.qkv(x).view(b, 1, -1), a.widths)  # (b, h or h_kv, 1, d_h) each
        start = 0 if self.cache is None else self.cache.end
        q, k = a.place_queries(q, start), a.place_keys(k, start)
        cache = KVCache(k, v, start=start) if self.cache is None else self.cache.extend(k, v)
        attended = a.attend(q, cache.key, cache.value, None, is_causal=True)[0]  # (b, 1, e)
        self.cache = cache if a.window is None else cache.keep_last(a.window - 1)
        return self.out(attended.view(b, -1))

    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` (in that order, repeats allowed)."""
        if self.cache is not None:
            self.cache = self.cache.index_select(index)


class MemoryAttention:
    """Cross-attention of rows to the encoder's memory, its keys and values projected once.

    Args:
        attention: the module whose steps run.
        q: its query product. kv: its fused key/value product, ``(n, e) -> (n, 2 h_kv d_h)``.
        out: its output product.
        memory: ``(m, s_m, e)`` the encoder's output.
        addend: ``(m, 1, 1, s_m)`` the memory's padding (:func:`padding_addend`).
    """

    def __init__(
        self, attention: MultiHeadAttention, q: Product, kv: Product, out: Product, memory: Tensor, addend: Tensor
    ) -> None:
        m, s, e = memory.shape
        self.attention, self.q, self.out = attention, q, out
        key, self.value = attention.split(kv(memory.reshape(m * s, e)).view(m, s, -1), attention.widths[1:])
        self.key = attention.place_keys(key, None)  # (m, h_kv, s_m, d_h)
        self.addend = addend  # (m, 1, 1, s_m)

    @property
    def rows(self) -> int:
        """``m``, the memory rows kept."""
        return self.key.size(0)

    def __call__(self, x: Tensor) -> Tensor:
        """``x (b, e)`` -> ``(b, e)``, where ``b`` is ``g * m``: rows ``i*g ... i*g + g - 1`` read memory row ``i``."""
        a, b, m = self.attention, x.size(0), self.rows
        # g = b / m consecutive rows (a sentence's beams) share a memory row: they are its g queries
        q = a.place_queries(a.heads(self.q(x).view(m, b // m, -1), a.num_heads), None)  # (m, h, g, d_h)
        attended = a.attend(q, self.key, self.value, self.addend)[0]  # (m, g, e)
        return self.out(attended.view(b, -1))

    def select(self, index: Tensor) -> None:
        """Keep the memory rows ``index`` (in that order, repeats allowed)."""
        self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
        self.addend = self.addend.index_select(0, index)
