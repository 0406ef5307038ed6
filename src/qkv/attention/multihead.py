"""Multi-head attention (section 3.2.2) with a key/value cache for incremental decoding.

Shape legend: ``b`` batch, ``s_q`` query length, ``s_k`` key length, ``e`` embed_dim,
``h`` heads, ``d_h`` head size (``e // h``).

MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O,  head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention.functional import scaled_dot_product_attention
from qkv.attention.masks import combine_masks
from qkv.runtime.padded_linear import Linear, linear


@dataclass
class KVCache:
    """Projected keys and values kept between decoding steps.

    ``static=False`` (self-attention): each call appends the new step's keys and values.
    ``static=True`` (cross-attention): the memory's keys and values, computed once and reused.
    """

    key: Tensor  # (b, h, s_k, d_h)
    value: Tensor  # (b, h, s_k, d_h)
    static: bool = False

    def __len__(self) -> int:
        return self.key.size(-2)

    def index_select(self, batch_index: Tensor) -> KVCache:
        """Reorder or repeat the batch rows (used by beam search)."""
        return KVCache(self.key.index_select(0, batch_index), self.value.index_select(0, batch_index), self.static)


@dataclass
class AttentionOutput:
    """What :class:`MultiHeadAttention` returns."""

    output: Tensor  # (b, s_q, e)
    weights: Tensor | None  # (b, h, s_q, s_k) per head, or None unless need_weights
    cache: KVCache  # keys/values to pass back in on the next decoding step


def _fusable(*projections: nn.Module) -> bool:
    """Plain ``nn.Linear`` projections without hooks, of the same input size, can be fused into
    one product; a hook (e.g. one that records a projection) needs its own module call."""
    return (
        all(type(p) in (nn.Linear, Linear) and not p._forward_hooks and not p._forward_pre_hooks for p in projections)
        and len({p.in_features for p in projections}) == 1
    )


class MultiHeadAttention(nn.Module):
    """Batch-first multi-head attention with separate ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``.

    Args:
        embed_dim: model width ``e``; must be divisible by ``num_heads``.
        num_heads: number of heads ``h``.
        kdim: feature size of the key input (defaults to ``embed_dim``).
        vdim: feature size of the value input (defaults to ``embed_dim``).
        dropout: dropout on the attention weights while training.
        bias: use biases in the four projections.
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
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.q_proj = Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias)

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
            q = self._split_heads(self.q_proj(query))  # (b, h, s_q, d_h)
            k, v = cache.key, cache.value  # cross-attention: memory projected once
        elif key is None:
            if value is not None:
                raise ValueError("value was given without key; pass both for cross-attention")
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(
                    f"self-attention (key=None) needs kdim == vdim == embed_dim, got kdim={self.kdim}, "
                    f"vdim={self.vdim}, embed_dim={self.embed_dim}; pass key and value"
                )
            if cache is None and _fusable(self.q_proj, self.k_proj, self.v_proj):
                q, k, v = self._fused_projection(query, (self.q_proj, self.k_proj, self.v_proj))
            else:
                # One new step (or hooked projections): three small products beat concatenating the weights every step.
                q = self._split_heads(self.q_proj(query))  # (b, h, s_q, d_h)
                k = self._split_heads(self.k_proj(query))  # (b, h, s_q, d_h)
                v = self._split_heads(self.v_proj(query))
                if cache is not None:
                    k = torch.cat([cache.key, k], dim=-2)  # (b, h, s_past + s_q, d_h)
                    v = torch.cat([cache.value, v], dim=-2)
        else:
            value = key if value is None else value
            self._check_key_value(query, key, value)
            q = self._split_heads(self.q_proj(query))  # (b, h, s_q, d_h)
            if value is key and _fusable(self.k_proj, self.v_proj):
                k, v = self._fused_projection(key, (self.k_proj, self.v_proj))  # (b, h, s_k, d_h) each
            else:
                k = self._split_heads(self.k_proj(key))  # (b, h, s_k, d_h)
                v = self._split_heads(self.v_proj(value))
        new_cache = KVCache(k, v, static=key is not None or (cache is not None and cache.static))

        mask = combine_masks(
            self._expand_attn_mask(attn_mask, b), self._expand_padding_mask(key_padding_mask, b, k.size(-2))
        )
        dropout_p = self.dropout if self.training else 0.0
        result = scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p, need_weights=need_weights
        )
        out, weights = result if isinstance(result, tuple) else (result, None)  # a tuple when need_weights
        out = out.transpose(1, 2).reshape(b, s_q, self.embed_dim)  # (b, s_q, e)
        return AttentionOutput(self.out_proj(out), weights, new_cache)

    def _fused_projection(self, x: Tensor, projections: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
        """Apply several same-input projections as one matrix product (fewer, larger kernels).

        The weights are concatenated in the forward pass, so autograd gives each ``nn.Linear``
        its own gradient and nothing is cached across optimizer steps. A missing bias counts as
        zeros. Returns one ``(b, h, s, d_h)`` tensor per projection.
        """
        b, s, _ = x.shape
        weight = torch.cat([p.weight for p in projections])  # (n * e, in)
        biases = [p.bias for p in projections]
        if all(bias is None for bias in biases):
            bias = None
        else:
            bias = torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in projections])
        fused = linear(x, weight, bias)  # (b, s, n * e)
        fused = fused.view(b, s, len(projections), self.num_heads, self.head_dim)  # (b, s, n, h, d_h)
        return fused.permute(2, 0, 3, 1, 4).unbind(0)  # n x (b, h, s, d_h)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (b, h, s, d_h)

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
