"""Transformer layers (section 3.1): feed-forward, encoder layer and decoder layer.

Post-LN as in the paper (``x = LayerNorm(x + Dropout(Sublayer(x)))``) by default; pre-LN
(``x = x + Dropout(Sublayer(LayerNorm(x)))``) with ``norm_first=True``. Dropout is applied to each
sub-layer's output before the residual sum (section 5.4).

Each layer's structure (which sub-layer, which norm, where the residual goes) is written once, in its
``compute`` method, over the sub-layers and norms it is given as callables. The module's ``forward``
gives its own attention modules, ``nn.Linear`` products, norms and dropouts;
:class:`qkv.decoding.inference.InferenceModel` gives the same layer packed or fused products and the
cached attention of :mod:`qkv.attention.incremental`, so the fast decoding path is this code too.

Shape legend: ``b`` batch, ``s`` target/self length, ``s_m`` memory length, ``d`` d_model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.multihead import AttentionOutput, KVCache, MultiHeadAttention, Rotation
from qkv.nn.dropout import Dropout
from qkv.nn.feedforward import ACTIVATIONS, FeedForward  # noqa: F401  (ACTIVATIONS re-exported)
from qkv.nn.norms import build_norm

Sublayer = Callable[[Tensor], Tensor]  # (..., d) -> (..., d): an attention or the feed-forward network


def residual(
    x: Tensor, sublayer: Sublayer, norm: Sublayer, norm_first: bool, dropout: Sublayer | None = None
) -> Tensor:
    """One residual sub-layer: ``x + dropout(sublayer(norm(x)))`` (pre-LN, ``norm_first``) or
    ``norm(x + dropout(sublayer(x)))`` (the paper's post-LN).

    Args:
        x: the hidden states ``(..., d)``.
        sublayer: the attention or feed-forward network, ``(..., d) -> (..., d)``.
        norm: the layer norm of this sub-layer.
        norm_first: pre-LN instead of post-LN.
        dropout: applied to the sub-layer's output before the sum; None: none (inference).

    Returns:
        The new hidden states, ``x``'s shape.
    """
    if norm_first:
        y = sublayer(norm(x))
        return x + (y if dropout is None else dropout(y))
    y = sublayer(x)
    return norm(x + (y if dropout is None else dropout(y)))


@dataclass(frozen=True)
class AttentionOptions:
    """How a layer's attention and norms are built, beyond the paper's (the defaults are the paper's).

    Attributes:
        norm: the layer's norms: ``layer`` (LayerNorm) or ``rms`` (RMSNorm).
        num_kv_heads: key/value heads (grouped-query attention); None: as many as the query heads.
        qkv_bias: biases on the q/k/v projections; None: as the layer's ``bias``.
        rotary: rotary positions for the self-attention (one module shared by the layers), or None.
        qk_norm: a norm of kind ``norm`` over each head's queries and keys.
        window: the self-attention's sliding window (keys a query sees, itself included), or None.
        alibi: ALiBi distance biases in the self-attention (in place of positions).
    """

    norm: str = "layer"
    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    rotary: Rotation | None = None
    qk_norm: bool = False
    window: int | None = None
    alibi: bool = False

    def attention(
        self, d_model: int, num_heads: int, dropout: float, bias: bool, eps: float, *, cross: bool = False
    ) -> MultiHeadAttention:
        """A :class:`MultiHeadAttention` with these options (``cross``: without positions or window)."""
        head_dim = d_model // num_heads if num_heads > 0 else 0
        return MultiHeadAttention(
            d_model,
            num_heads,
            dropout=dropout,
            bias=bias,
            num_kv_heads=self.num_kv_heads,
            qkv_bias=self.qkv_bias,
            rotary=None if cross else self.rotary,
            q_norm=build_norm(self.norm, head_dim, eps) if self.qk_norm else None,
            k_norm=build_norm(self.norm, head_dim, eps) if self.qk_norm else None,
            window=None if cross else self.window,
            alibi=self.alibi and not cross,
        )


@dataclass
class LayerOutput:
    """What a layer returns: the hidden states, attention weights if asked, and caches."""

    output: Tensor  # (b, s, d)
    self_weights: Tensor | None = None  # (b, h, s, s_k)
    cross_weights: Tensor | None = None  # (b, h, s, s_m)
    self_cache: KVCache | None = None
    cross_cache: KVCache | None = None


# A pytree node, so that code which walks a module's outputs with torch's pytree finds the tensors in it:
# FSDP2 hangs its pre-backward hook (which gathers a sharded layer's weights again for the backward) on
# the output tensors it finds that way, and torch 2.11's FSDP2 looks no further than pytree (2.13 also
# opens dataclasses); without this, a sharded layer's backward met freed weights on torch 2.11.
torch.export.register_dataclass(LayerOutput)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward. With ``is_causal=True`` it is a decoder-only (LM) block."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        **attention: Any,
    ) -> None:
        """Args:
        d_model: model width. num_heads: attention heads. d_ff: feed-forward inner width.
        dropout: residual dropout on each sub-layer's output (section 5.4).
        attention_dropout: dropout on attention weights (not in the paper).
        activation: a name of :data:`~qkv.nn.feedforward.ACTIVATIONS`: ``relu`` (paper), ``gelu``,
            ``gelu_tanh``, ``relu2``, ``silu``, or a gated one (``swiglu``, ``geglu``).
        norm_first: pre-LN instead of the paper's post-LN. layer_norm_eps: the norms' epsilon.
        bias: biases in attention and feed-forward projections.
        **attention: the options of today's attention (:class:`AttentionOptions`' fields): ``norm``,
            ``num_kv_heads``, ``qkv_bias``, ``rotary``, ``qk_norm``, ``window``, ``alibi``.
        """
        super().__init__()
        options = AttentionOptions(**attention)
        self.norm_first = norm_first
        self.self_attn = options.attention(d_model, num_heads, attention_dropout, bias, layer_norm_eps)
        self.feed_forward = FeedForward(d_model, d_ff, dropout=dropout, activation=activation, bias=bias)
        self.norm1 = build_norm(options.norm, d_model, layer_norm_eps)
        self.norm2 = build_norm(options.norm, d_model, layer_norm_eps)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> LayerOutput:
        """Args: ``x (b, s, d)``; masks as in :class:`MultiHeadAttention`. Returns :class:`LayerOutput`."""

        def attend(h: Tensor) -> AttentionOutput:
            return self.self_attn(
                h,
                key_padding_mask=key_padding_mask,
                attn_mask=attn_mask,
                is_causal=is_causal,
                need_weights=need_weights,
                cache=cache,
            )

        records: list[AttentionOutput] = []  # what the attention returned besides its output

        def self_attention(h: Tensor) -> Tensor:
            records.append(attend(h))
            return records[-1].output

        norms, dropouts = (self.norm1, self.norm2), (self.dropout1, self.dropout2)
        x = self.compute(x, self_attention, self.feed_forward, norms, dropouts)
        return LayerOutput(x, self_weights=records[0].weights, self_cache=records[0].cache)

    def compute(
        self,
        x: Tensor,
        self_attention: Sublayer,
        feed_forward: Sublayer,
        norms: tuple[Sublayer, Sublayer],
        dropouts: tuple[Sublayer | None, Sublayer | None] = (None, None),
    ) -> Tensor:
        """The layer's structure over given sub-layers (see the module's docstring).

        Args:
            x: ``(..., d)``.
            self_attention: ``(..., d) -> (..., d)``, the attention with its masks bound.
            feed_forward: ``(..., d) -> (..., d)``.
            norms: the two sub-layers' norms, in order.
            dropouts: the two sub-layers' residual dropouts (None: none).

        Returns:
            ``(..., d)``.
        """
        x = residual(x, self_attention, norms[0], self.norm_first, dropouts[0])
        return residual(x, feed_forward, norms[1], self.norm_first, dropouts[1])


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder memory, then feed-forward."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        **attention: Any,
    ) -> None:
        """Args: as :class:`EncoderLayer`'s; the cross-attention has the same heads and norms, and
        neither rotary positions nor a window (the memory's positions are another sequence's).
        """
        super().__init__()
        options = AttentionOptions(**attention)
        self.norm_first = norm_first
        self.self_attn = options.attention(d_model, num_heads, attention_dropout, bias, layer_norm_eps)
        self.cross_attn = options.attention(d_model, num_heads, attention_dropout, bias, layer_norm_eps, cross=True)
        self.feed_forward = FeedForward(d_model, d_ff, dropout=dropout, activation=activation, bias=bias)
        self.norm1 = build_norm(options.norm, d_model, layer_norm_eps)
        self.norm2 = build_norm(options.norm, d_model, layer_norm_eps)
        self.norm3 = build_norm(options.norm, d_model, layer_norm_eps)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        self_attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        is_causal: bool = True,
        need_weights: bool = False,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ) -> LayerOutput:
        """Args:
        x: target states ``(b, s, d)``.
        memory: encoder output ``(b, s_m, d)`` (ignored when ``cross_cache`` holds it).
        self_attn_mask: extra mask for self-attention, ``(s, s_k)`` or 4-D.
        key_padding_mask: ``(b, s_k)`` target padding (True = real), cached keys included.
        memory_key_padding_mask: ``(b, s_m)`` source padding (True = real).
        is_causal: mask future target positions (bottom-right aligned, cache-safe).
        need_weights: return self- and cross-attention weights.
        self_cache, cross_cache: caches from the previous decoding step.
        """

        def self_attend(h: Tensor) -> AttentionOutput:
            return self.self_attn(
                h,
                key_padding_mask=key_padding_mask,
                attn_mask=self_attn_mask,
                is_causal=is_causal,
                need_weights=need_weights,
                cache=self_cache,
            )

        def cross_attend(h: Tensor) -> AttentionOutput:
            return self.cross_attn(
                h, memory, key_padding_mask=memory_key_padding_mask, need_weights=need_weights, cache=cross_cache
            )

        records: dict[str, AttentionOutput] = {}  # what each attention returned besides its output

        def self_attention(h: Tensor) -> Tensor:
            records["self"] = self_attend(h)
            return records["self"].output

        def cross_attention(h: Tensor) -> Tensor:
            records["cross"] = cross_attend(h)
            return records["cross"].output

        norms, dropouts = (self.norm1, self.norm2, self.norm3), (self.dropout1, self.dropout2, self.dropout3)
        x = self.compute(x, self_attention, cross_attention, self.feed_forward, norms, dropouts)
        sa, ca = records["self"], records["cross"]
        return LayerOutput(x, sa.weights, ca.weights, sa.cache, ca.cache)

    def compute(
        self,
        x: Tensor,
        self_attention: Sublayer,
        cross_attention: Sublayer,
        feed_forward: Sublayer,
        norms: tuple[Sublayer, Sublayer, Sublayer],
        dropouts: tuple[Sublayer | None, Sublayer | None, Sublayer | None] = (None, None, None),
    ) -> Tensor:
        """The layer's structure over given sub-layers (see the module's docstring).

        Args:
            x: ``(..., d)``.
            self_attention: ``(..., d) -> (..., d)``, the masked self-attention with its cache bound.
            cross_attention: ``(..., d) -> (..., d)``, the attention over the encoder's memory.
            feed_forward: ``(..., d) -> (..., d)``.
            norms: the three sub-layers' norms, in order.
            dropouts: the three sub-layers' residual dropouts (None: none).

        Returns:
            ``(..., d)``.
        """
        x = residual(x, self_attention, norms[0], self.norm_first, dropouts[0])
        x = residual(x, cross_attention, norms[1], self.norm_first, dropouts[1])
        return residual(x, feed_forward, norms[2], self.norm_first, dropouts[2])
