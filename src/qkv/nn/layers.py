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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.multihead import AttentionOutput, KVCache, MultiHeadAttention
from qkv.nn.dropout import Dropout
from qkv.runtime.padded_linear import Linear

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


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


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2 (section 3.3), with dropout after the activation."""

    def __init__(self, d_model: int, d_ff: int, *, dropout: float = 0.0, activation: str = "relu", bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.linear1 = Linear(d_model, d_ff, bias=bias)
        self.linear2 = Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        """The network over ``x``, each position on its own.

        Args:
            x: ``(..., d)`` hidden states.

        Returns:
            ``x``'s shape.
        """
        return self.compute(x, self._first, self.linear2, self.dropout)  # (b, s, d)

    def _first(self, x: Tensor) -> Tensor:
        return ACTIVATIONS[self.activation](self.linear1(x))  # act(x W_1 + b_1)

    @staticmethod
    def compute(x: Tensor, first: Sublayer, second: Sublayer, dropout: Sublayer | None = None) -> Tensor:
        """The network over given products: ``second(dropout(first(x)))``.

        Args:
            x: ``(..., d)``.
            first: ``act(x W_1 + b_1)``, the activation included (an inference product may compute it in
                the product's own pass).
            second: ``h W_2 + b_2``.
            dropout: after the activation; None: none.

        Returns:
            ``(..., d)``.
        """
        h = first(x)
        return second(h if dropout is None else dropout(h))


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
    ) -> None:
        """Args:
        d_model: model width. num_heads: attention heads. d_ff: feed-forward inner width.
        dropout: residual dropout on each sub-layer's output (section 5.4).
        attention_dropout: dropout on attention weights (not in the paper).
        activation: ``relu`` (paper), ``gelu`` or ``gelu_tanh``.
        norm_first: pre-LN instead of the paper's post-LN. layer_norm_eps: LayerNorm epsilon.
        bias: biases in attention and feed-forward projections.
        """
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=attention_dropout, bias=bias)
        self.feed_forward = FeedForward(d_model, d_ff, dropout=dropout, activation=activation, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
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
    ) -> None:
        """Args:
        d_model: model width. num_heads: attention heads. d_ff: feed-forward inner width.
        dropout: residual dropout on each sub-layer's output (section 5.4).
        attention_dropout: dropout on attention weights (not in the paper).
        activation: ``relu`` (paper), ``gelu`` or ``gelu_tanh``.
        norm_first: pre-LN instead of the paper's post-LN. layer_norm_eps: LayerNorm epsilon.
        bias: biases in attention and feed-forward projections.
        """
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=attention_dropout, bias=bias)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout=attention_dropout, bias=bias)
        self.feed_forward = FeedForward(d_model, d_ff, dropout=dropout, activation=activation, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
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
