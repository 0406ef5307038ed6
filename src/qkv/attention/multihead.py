"""Multi-head attention (section 3.2.2) with a key/value cache for incremental decoding, and the
variants of today's models: grouped-query heads, rotary positions, a norm over each head's queries and
keys, a sliding window.

Shape legend: ``b`` batch, ``s_q`` query length, ``s_k`` key length, ``e`` embed_dim,
``h`` heads, ``h_kv`` key/value heads, ``d_h`` head size (``e // h``).

MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O,  head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i)

The attention is written once, as three steps that every caller runs: :meth:`MultiHeadAttention.heads`
(the projected rows split into heads), :meth:`~MultiHeadAttention.place_queries` and
:meth:`~MultiHeadAttention.place_keys` (the per-head norm and the rotary positions, at the positions
the queries and keys hold), :meth:`MultiHeadAttention.attend` (the
kernel, the window, the heads merged back). ``forward`` runs them over the module's own projections;
:mod:`qkv.attention.incremental` runs the same three over the fused or packed products of decoding's
fast path, so a variant added to these steps is in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from qkv.attention.alibi import alibi_bias, alibi_slopes
from qkv.attention.cache import KVCache
from qkv.attention.functional import attention_kernel, check_attention_inputs
from qkv.attention.masks import combine_masks, sliding_window_mask
from qkv.runtime.padded_linear import Linear, linear

__all__ = ["AttentionOutput", "KVCache", "MultiHeadAttention", "Rotation"]  # KVCache: re-exported


class Rotation(Protocol):
    """Rotary positions (:class:`qkv.nn.rotary.RotaryEmbedding`): ``rotate(x, positions)`` turns each
    head's queries or keys ``x (b, h, s, d_h)`` by their positions ``(s,)``."""

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x (b, h, s, d_h)`` turned by ``positions (s,)``; ``x``'s shape and dtype."""
        ...


@dataclass
class AttentionOutput:
    """What :class:`MultiHeadAttention` returns."""

    output: Tensor  # (b, s_q, e)
    weights: Tensor | None  # (b, h, s_q, s_k) per head, or None unless need_weights
    cache: KVCache  # keys/values to pass back in on the next decoding step


class MultiHeadAttention(nn.Module):
    """Batch-first multi-head attention with separate ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``.

    Args:
        embed_dim: model width ``e``; must be divisible by ``num_heads``.
        num_heads: number of heads ``h``.
        kdim: feature size of the key input (defaults to ``embed_dim``).
        vdim: feature size of the value input (defaults to ``embed_dim``).
        dropout: dropout on the attention weights while training.
        bias: use biases in the four projections.
        num_kv_heads: key/value heads ``h_kv`` (grouped-query attention; 1: multi-query); None: ``h``.
        qkv_bias: biases on the q/k/v projections; None: as ``bias`` (which then covers ``out_proj``).
        rotary: rotary positions applied to each head's queries and keys
            (:class:`qkv.nn.rotary.RotaryEmbedding`), or None.
        q_norm: a norm over each head's queries (``d_h`` features), before the rotary positions
            (QK-norm), or None.
        k_norm: the same over each head's keys, or None.
        window: sliding-window attention: a query sees itself and the ``window - 1`` keys before it
            (with ``is_causal``); a self-attention cache keeps only those. None: every key.
        alibi: ALiBi: each head's scores biased by the query-key distance times the head's slope
            (:mod:`qkv.attention.alibi`), in place of positions.

    ``fuse_projections`` (an attribute, True by default): the q/k/v weights of a self-attention
    without a cache (and the k/v of a cross-attention) are concatenated into one product, fewer and
    larger kernels; the projection modules' own ``forward`` (and its hooks) then do not run. Set it to
    False to call each projection module (a wrapped or hooked projection).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        num_kv_heads: int | None = None,
        qkv_bias: bool | None = None,
        rotary: Rotation | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        window: int | None = None,
        alibi: bool = False,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if kv_heads <= 0 or num_heads % kv_heads != 0:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be positive and divide num_heads ({num_heads})")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.window = window
        self.fuse_projections = True
        in_bias = bias if qkv_bias is None else qkv_bias
        kv_width = kv_heads * self.head_dim
        self._widths = (embed_dim, kv_width, kv_width)
        self._groups = num_heads // kv_heads  # query heads per key/value head
        self.q_proj = Linear(embed_dim, embed_dim, bias=in_bias)
        self.k_proj = Linear(self.kdim, kv_width, bias=in_bias)
        self.v_proj = Linear(self.vdim, kv_width, bias=in_bias)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias)
        self.rotary = rotary
        self._alibi = alibi  # a plain flag: read every step, where a buffer lookup costs more
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads) if alibi else None, persistent=False)
        self.q_norm = q_norm
        self.k_norm = k_norm

    @property
    def widths(self) -> tuple[int, int, int]:
        """The q, k and v projections' output sizes: ``(h d_h, h_kv d_h, h_kv d_h)``."""
        return self._widths

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> AttentionOutput:
        """Attend from ``query`` to ``key``/``value`` (self-attention when ``key`` is None).

        Args:
            query: ``(b, s_q, e)``.
            key: ``(b, s_k, kdim)``, or None for self-attention.
            value: ``(b, s_k, vdim)``; defaults to ``key``.
            key_padding_mask: ``(b, s_k)`` bool, True = real token. With a self-attention cache,
                ``s_k`` counts the cached keys too.
            attn_mask: bool (True = may attend) or additive float, ``(s_q, s_k)``,
                ``(b, s_q, s_k)`` or ``(b, h, s_q, s_k)``.
            is_causal: causal mask aligned bottom-right (correct with a cache).
            need_weights: return per-head weights ``(b, h, s_q, s_k)``.
            cache: the cache returned by the previous step (see :class:`KVCache`).

        Returns:
            :class:`AttentionOutput` with ``output (b, s_q, e)``, ``weights`` and ``cache``.
        """
        self._check_query(query)
        b, s_q, _ = query.shape
        if cache is not None and cache.static:
            q = self.place_queries(self.heads(self.q_proj(query), self.num_heads), None)  # (b, h, s_q, d_h)
            new_cache = cache  # cross-attention: memory projected once
        elif key is None:
            if value is not None:
                raise ValueError("value was given without key; pass both for cross-attention")
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(
                    f"self-attention (key=None) needs kdim == vdim == embed_dim, got kdim={self.kdim}, "
                    f"vdim={self.vdim}, embed_dim={self.embed_dim}; pass key and value"
                )
            if cache is None and self._fuses(self.q_proj, self.k_proj, self.v_proj):
                q, k, v = self.split(self._fused(query, self.q_proj, self.k_proj, self.v_proj), self.widths)
            else:
                # One new step (or projections called on their own): three small products beat
                # concatenating the weights every step.
                q, k, v = (self.heads(self.q_proj(query), self.num_heads),) + self._kv_heads(query, query)
            # the position of this call's first query and key (per row, in a batch of joined members)
            start = 0 if cache is None else cache.next_positions
            q, k = self.place_queries(q, start), self.place_keys(k, start)
            new_cache = KVCache(k, v) if cache is None else cache.extend(k, v)
        else:
            value = key if value is None else value
            self._check_key_value(query, key, value)
            q = self.place_queries(self.heads(self.q_proj(query), self.num_heads), None)
            k, v = self._kv_heads(key, value)
            new_cache = KVCache(self.place_keys(k, None), v, static=True)
        mask = combine_masks(
            self._expand_attn_mask(attn_mask, b),
            self._expand_padding_mask(key_padding_mask, b, new_cache.key.size(-2)),
            new_cache.padding_mask(),
        )
        check_attention_inputs(q, new_cache.key, new_cache.value, mask, kv_groups=self._groups)  # the caller's masks
        out, weights = self.attend(q, new_cache.key, new_cache.value, mask, is_causal, need_weights)
        if not new_cache.static and self.window is not None:
            new_cache = new_cache.keep_last(self.window - 1)
        return AttentionOutput(self.out_proj(out), weights, new_cache)

    def heads(self, x: Tensor, heads: int) -> Tensor:
        """``x (b, s, heads * d_h)`` (projected rows) -> ``(b, heads, s, d_h)`` (a view)."""
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def split(self, fused: Tensor, widths: tuple[int, ...]) -> tuple[Tensor, ...]:
        """One product of several projections, ``(b, s, sum(widths))``, as each one's heads
        ``(b, heads_i, s, d_h)`` (views; the q width has ``h`` heads, a k or v width ``h_kv``)."""
        b, s, _ = fused.shape
        if self._groups == 1:  # equal widths: one view (b, s, n, h, d_h) of the product, its n parts
            return fused.view(b, s, len(widths), self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return tuple(self.heads(part, part.size(-1) // self.head_dim) for part in fused.split(widths, dim=-1))

    def place_queries(self, q: Tensor, start: int | Tensor | None) -> Tensor:
        """The per-head steps between the query projection and the kernel: the QK-norm's query
        norm, then the rotary positions ``start, start + 1, ...``.

        Args:
            q: ``(b, h, s, d_h)``.
            start: the first query's position, or ``(b,)`` each row's; None: a cross-attention's
                queries, which get no positions (the positions of two sequences do not compare).

        Returns:
            ``q``'s shape.
        """
        if self.q_norm is not None:
            q = self.q_norm(q).to(q.dtype)  # a float32 norm weight must not promote bf16 heads (autocast)
        return q if start is None or self.rotary is None else self.rotary.rotate(q, self._positions(q, start))

    def place_keys(self, k: Tensor, start: int | Tensor | None) -> Tensor:
        """As :meth:`place_queries`, for keys ``(b, h_kv, s, d_h)`` (the key norm)."""
        if self.k_norm is not None:
            k = self.k_norm(k).to(k.dtype)
        return k if start is None or self.rotary is None else self.rotary.rotate(k, self._positions(k, start))

    @staticmethod
    def _positions(x: Tensor, start: int | Tensor) -> Tensor:
        if isinstance(start, Tensor):  # (b,) a row's own first position
            return start[:, None] + torch.arange(x.size(-2), device=x.device)  # (b, s)
        return torch.arange(start, start + x.size(-2), device=x.device)  # (s,)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The kernel over the heads, and the heads merged back.

        Args:
            q: ``(b, h, s_q, d_h)``. k, v: ``(b, h_kv, s_k, d_h)``, the last ``s_q`` keys at the
                queries' positions (bottom-right alignment).
            mask: bool (True = may attend) or additive, broadcastable to ``(b, h, s_q, s_k)``.
            is_causal: the causal mask, aligned bottom-right; with :attr:`window`, the window too.
                With ALiBi slopes, their distance bias is added to ``mask``.
            need_weights: also return the weights ``(b, h, s_q, s_k)``.

        Returns:
            ``(out (b, s_q, h * d_h), weights or None)``; ``out`` before ``out_proj``.
        """
        if self._alibi and self.alibi_slopes is not None:  # distances bottom-right aligned: last query, last key
            s_q, s_k = q.size(-2), k.size(-2)
            mask = combine_masks(mask, alibi_bias(self.alibi_slopes, s_q, s_k, offset=max(s_k - s_q, 0)))
        if is_causal and self.window is not None and self.window < k.size(-2):
            mask = combine_masks(mask, sliding_window_mask(q.size(-2), k.size(-2), self.window, device=q.device))
            is_causal = False  # the window's mask holds the causal one
        if is_causal and q.size(-2) == 1:
            is_causal = False  # one new query (a decoding step) sees every key: no mask to build
        dropout_p = self.dropout if self.training else 0.0
        # q, k, v are this module's own, of the shapes it made: the kernel without the public checks
        result = attention_kernel(q, k, v, mask, is_causal, dropout_p, None, need_weights, self._groups)
        out, weights = result if isinstance(result, tuple) else (result, None)  # a tuple when need_weights
        b, _, s_q, _ = out.shape
        return out.transpose(1, 2).reshape(b, s_q, self.embed_dim), weights

    def _fuses(self, *projections: nn.Module) -> bool:
        """Whether to compute ``projections`` as one product (see the class docstring): plain
        ``nn.Linear`` maps of one input size, and :attr:`fuse_projections` on."""
        return (
            self.fuse_projections
            and all(isinstance(p, nn.Linear) for p in projections)
            and len({p.in_features for p in projections}) == 1
        )

    def _kv_heads(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The key and value heads ``(b, h_kv, s_k, d_h)``, one product when they share an input."""
        if value is key and self._fuses(self.k_proj, self.v_proj):
            k, v = self.split(self._fused(key, self.k_proj, self.v_proj), self.widths[1:])
            return k, v
        return self.heads(self.k_proj(key), self.num_kv_heads), self.heads(self.v_proj(value), self.num_kv_heads)

    @staticmethod
    def _fused(x: Tensor, *projections: nn.Linear) -> Tensor:
        """Several same-input projections as one matrix product ``(b, s, sum of outputs)``.

        The weights are concatenated in the forward pass, so autograd gives each ``nn.Linear`` its
        own gradient and nothing is cached across optimizer steps. A missing bias counts as zeros.
        """
        weight = torch.cat([p.weight for p in projections])  # (sum of outputs, in)
        biases = [p.bias for p in projections]
        if all(bias is None for bias in biases):
            return linear(x, weight, None)
        bias = torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in projections])
        return linear(x, weight, bias)

    def _check_query(self, query: Tensor) -> None:
        if query.dim() != 3:
            raise ValueError(f"query must be (batch, seq, embed_dim), got shape {tuple(query.shape)}")
        if query.size(-1) != self.embed_dim:
            raise ValueError(f"query has {query.size(-1)} features, expected embed_dim={self.embed_dim}")

    def _check_key_value(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        if key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                f"key and value must be (batch, seq, dim), got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if key.size(-1) != self.kdim or value.size(-1) != self.vdim:
            raise ValueError(
                f"key/value feature sizes {key.size(-1)}/{value.size(-1)} do not match "
                f"kdim={self.kdim}/vdim={self.vdim}"
            )
        if key.size(0) != query.size(0) or value.size(0) != query.size(0) or key.size(1) != value.size(1):
            raise ValueError(
                f"batch/sequence sizes disagree: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}"
            )
        if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
            raise ValueError(
                f"query, key, value must share dtype and device, got {query.dtype}/{query.device}, "
                f"{key.dtype}/{key.device}, {value.dtype}/{value.device}"
            )

    @staticmethod
    def _expand_padding_mask(key_padding_mask: Tensor | None, b: int, s_k: int) -> Tensor | None:
        if key_padding_mask is None:
            return None
        if key_padding_mask.shape != (b, s_k):
            raise ValueError(
                f"key_padding_mask must be (batch, s_k) = ({b}, {s_k}), got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool (True = real token), got {key_padding_mask.dtype}")
        return key_padding_mask[:, None, None, :]  # (b, 1, 1, s_k)

    @staticmethod
    def _expand_attn_mask(attn_mask: Tensor | None, b: int) -> Tensor | None:
        if attn_mask is None or attn_mask.dim() in (2, 4):
            return attn_mask
        if attn_mask.dim() == 3 and attn_mask.size(0) in (1, b):
            return attn_mask[:, None]  # (b, 1, s_q, s_k)
        raise ValueError(
            f"attn_mask must be (s_q, s_k), (b, s_q, s_k) or (b, h, s_q, s_k); got {tuple(attn_mask.shape)}"
        )
