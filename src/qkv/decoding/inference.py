"""A trained :class:`~qkv.models.transformer.Transformer` made ready to decode: :class:`InferenceModel`.

``InferenceModel.build(model)`` takes the model's weights of that moment, once: every linear map of
its layers becomes a product (:mod:`qkv.decoding.packed_linear`: packed for oneDNN where that pays on
this CPU, else ``F.linear`` over a copy), the self-attention's q/k/v fused into one product and the
cross-attention's k/v into another. It runs the model's own layers, not a copy of them: each layer's
structure is its ``compute`` method (:mod:`qkv.nn.layers`), given these products, the norms and the
cached attention of :mod:`qkv.attention.incremental`. The embeddings, positions and the final norm
are the model's modules, called as they are.

The caller owns the object: it keeps computing with the weights it was built with, so build a new one
after the model's weights change (a training step, ``load_state_dict``). Nothing is cached anywhere
else. :func:`qkv.decoding.search.greedy_decode`, :func:`~qkv.decoding.search.beam_search` and
:func:`qkv.decoding.translate.translate_texts` take one in place of the model (and build one per call
when given a plain model where :func:`applies`).

Per decoding call, :meth:`InferenceModel.steps` gives the decoder's state for one batch of sentences:
each layer's keys and values so far, the memory's keys and values projected once, kept once per
sentence for its beams (:class:`~qkv.attention.incremental.MemoryAttention`).

Shape legend: ``b`` rows (sentences, times the beam), ``d`` d_model, ``s_src`` source length,
``V`` target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.incremental import CachedSelfAttention, MemoryAttention, padding_addend, self_attention
from qkv.attention.multihead import MultiHeadAttention
from qkv.decoding.packed_linear import PackedLinear, fuse
from qkv.models.transformer import EncoderOutput, Transformer, TransformerConfig
from qkv.nn.layers import DecoderLayer, EncoderLayer, FeedForward

Norm = Callable[[Tensor], Tensor]


def applies(model: nn.Module) -> bool:
    """Whether decoding ``model`` through an :class:`InferenceModel` computes what its own ``decode``
    would, and faster: a :class:`Transformer` in eval mode with float32 weights on the CPU, outside
    autocast. Elsewhere the decoding functions call the model's ``encode`` and ``decode``."""
    if not isinstance(model, Transformer) or model.training:
        return False
    weight = model.output_proj.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def _norm(norm: nn.Module) -> Norm:
    """A layer norm as a function (no module call per step); another norm as itself."""
    if isinstance(norm, nn.LayerNorm):
        shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    return norm


def _pair(linear: nn.Module) -> tuple[Tensor, Tensor | None]:
    return linear.weight, linear.bias  # type: ignore[return-value]


def _product(linear: nn.Module, activation: str | None = None) -> PackedLinear:
    return PackedLinear(linear.weight, linear.bias, activation=activation)  # type: ignore[arg-type]


@dataclass
class _Attention:
    """One :class:`MultiHeadAttention`'s products: q/k/v fused (self) or q and k/v fused (cross)."""

    module: MultiHeadAttention  # whose steps (heads, positions, kernel) run over these products
    out: PackedLinear
    qkv: PackedLinear | None = None
    q: PackedLinear | None = None
    kv: PackedLinear | None = None

    @classmethod
    def of_self(cls, attention: MultiHeadAttention) -> _Attention:
        qkv = fuse(_pair(attention.q_proj), _pair(attention.k_proj), _pair(attention.v_proj))
        return cls(attention, _product(attention.out_proj), qkv=qkv)

    @classmethod
    def of_cross(cls, attention: MultiHeadAttention) -> _Attention:
        kv = fuse(_pair(attention.k_proj), _pair(attention.v_proj))
        return cls(attention, _product(attention.out_proj), q=_product(attention.q_proj), kv=kv)


class _FeedForward:
    """A :class:`FeedForward`'s products: the first with its activation (oneDNN's post-op where packed),
    or, gated, the gate's and the up products fused, gated by :meth:`FeedForward.gating`."""

    def __init__(self, feed_forward: FeedForward) -> None:
        self.compute = feed_forward.compute
        self.first: Callable[[Tensor], Tensor]
        if feed_forward.gate is None:
            self.first = _product(feed_forward.linear1, activation=feed_forward.activation)  # act(x W_1 + b_1)
        else:  # gated: the gate's and the up products as one, the module's gating rule over the halves
            both = fuse(_pair(feed_forward.gate), _pair(feed_forward.linear1))
            width, gating = feed_forward.linear1.out_features, FeedForward.gating(feed_forward.activation)
            self.first = lambda x: gating(*both(x).split(width, dim=-1))
        self.second = _product(feed_forward.linear2)

    def __call__(self, x: Tensor) -> Tensor:
        return self.compute(x, self.first, self.second)


class _Encoder:
    """An :class:`EncoderLayer` with its products, over rows ``(b * s_src, d)``."""

    def __init__(self, layer: EncoderLayer) -> None:
        self.compute = layer.compute
        self.attention = _Attention.of_self(layer.self_attn)
        self.feed_forward = _FeedForward(layer.feed_forward)
        self.norms = (_norm(layer.norm1), _norm(layer.norm2))

    def __call__(self, x: Tensor, b: int, s: int, addend: Tensor) -> Tensor:
        a = self.attention
        assert a.qkv is not None

        def attend(h: Tensor) -> Tensor:
            return self_attention(a.module, a.qkv, a.out, h, b, s, addend)  # type: ignore[arg-type]

        return self.compute(x, attend, self.feed_forward, self.norms)


class _Decoder:
    """A :class:`DecoderLayer` with its products; :meth:`state` its attention's state for one call."""

    def __init__(self, layer: DecoderLayer) -> None:
        self.compute = layer.compute
        self.own = _Attention.of_self(layer.self_attn)
        self.cross = _Attention.of_cross(layer.cross_attn)
        self.feed_forward = _FeedForward(layer.feed_forward)
        self.norms = (_norm(layer.norm1), _norm(layer.norm2), _norm(layer.norm3))

    def state(self, memory: Tensor, addend: Tensor) -> tuple[CachedSelfAttention, MemoryAttention]:
        own, cross = self.own, self.cross
        assert own.qkv is not None and cross.q is not None and cross.kv is not None
        return (
            CachedSelfAttention(own.module, own.qkv, own.out),
            MemoryAttention(cross.module, cross.q, cross.kv, cross.out, memory, addend),
        )


class InferenceModel:
    """A :class:`Transformer`'s decoding with the weights of the moment it was built (see the module's
    docstring). Build it with :meth:`build`; it looks like the model to the decoding functions
    (``config``, ``encode``) and adds :meth:`steps`.

    Args:
        model: the Transformer; its layers, embeddings and norms are used, its linear weights copied.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.config: TransformerConfig = model.config
        self.device = model.output_proj.weight.device
        self.encoder_layers = [_Encoder(layer) for layer in model.encoder.layers]  # type: ignore[arg-type]
        self.decoder_layers = [_Decoder(layer) for layer in model.decoder.layers]  # type: ignore[arg-type]
        self.project = _product(model.output_proj)

    @classmethod
    @torch.inference_mode()
    def build(cls, model: Transformer) -> InferenceModel:
        """Pack ``model``'s weights of now for decoding.

        Args:
            model: a :class:`Transformer`; it is put in eval mode.

        Returns:
            The inference object, owned by the caller.
        """
        if not isinstance(model, Transformer):
            raise ValueError(f"InferenceModel.build needs a qkv Transformer, got {type(model).__name__}")
        model.eval()
        return cls(model)

    def eval(self) -> InferenceModel:
        """Nothing to do (the model was put in eval mode when this was built); for the decoding
        functions, which call it on what they are given."""
        return self

    @torch.inference_mode()
    def encode(self, src: Tensor) -> EncoderOutput:
        """``model.encode(src)``'s memory (no attention weights): ``src (b, s_src)`` padded ids."""
        model = self.model
        real = src != self.config.pad_id  # (b, s_src) True = a real source token
        addend = padding_addend(real)  # (b, 1, 1, s_src)
        x = model.src_embed(src)  # (b, s_src, d)
        b, s, d = x.shape
        rows = x.reshape(b * s, d)
        for layer in self.encoder_layers:
            rows = layer(rows, b, s, addend)
        if model.encoder.norm is not None:
            rows = model.encoder.norm(rows)
        return EncoderOutput(rows.view(b, s, d), None, real)

    def steps(self, memory: EncoderOutput) -> InferenceSteps:
        """The decoder's state for one decoding call over ``memory`` (what :meth:`encode` returned)."""
        return InferenceSteps(self, memory)


class InferenceSteps:
    """An :class:`InferenceModel`'s decoder steps for one batch of sentences, as
    :class:`qkv.decoding.steps.Steps`: ``steps(tokens)`` -> the next token's logits, ``select``."""

    def __init__(self, inference: InferenceModel, memory: EncoderOutput) -> None:
        if memory.key_padding_mask is None:
            raise ValueError("the memory needs its key_padding_mask (InferenceModel.encode sets it)")
        addend = padding_addend(memory.key_padding_mask)  # (b, 1, 1, s_src), built once
        self.layers = [layer.state(memory.hidden, addend) for layer in inference.decoder_layers]
        self.computes = [(layer.compute, layer.feed_forward, layer.norms) for layer in inference.decoder_layers]
        self.embed, self.final_norm = inference.model.tgt_embed, inference.model.decoder.norm
        self.project = inference.project
        self.length = 0  # positions decoded so far
        self.rows = memory.hidden.size(0)  # rows decoded: a multiple of the memory's rows kept (see select)

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens (b, t)``, BOS first -> the logits of the token after them, ``(b, V)``."""
        if self.length == 0 and tokens.size(1) != 1:
            raise ValueError("InferenceSteps starts from BOS alone")
        x = self.embed(tokens[:, -1:], self.length)[:, 0]  # (b, d)
        for (own, cross), (compute, feed_forward, norms) in zip(self.layers, self.computes):
            x = compute(x, own, cross, feed_forward, norms)
        if self.final_norm is not None:
            x = self.final_norm(x)
        self.length += 1
        return self.project(x)  # (b, V)

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        """As :meth:`qkv.decoding.steps.Steps.select`. The memory is kept once per group of consecutive
        rows that share it (a sentence's beams: ``memory_index`` repeating each of its values ``g`` times
        in a row), and its keys and values are not copied ``g`` times."""
        if memory_index is not None:
            group = self.rows // self.layers[0][1].rows  # rows a kept memory row serves now
            memory_index = _runs(memory_index // group)  # (the kept memory row each new row reads)
        self.rows = index.numel()
        for own, cross in self.layers:
            own.select(index)
            if memory_index is not None:
                cross.select(memory_index)


def _runs(shared: Tensor) -> Tensor:
    """``shared (n,)``, the memory row each row reads -> each run's value once, where ``shared`` is runs of
    ``g`` equal values (the same ``g`` throughout: rows in groups of ``g`` read one memory row); else
    ``shared`` itself (a memory row per row)."""
    n = shared.numel()
    g = int((shared == shared[0]).cumprod(0).sum()) if n else 1  # the first run's length
    if g > 1 and n % g == 0:
        runs = shared.view(-1, g)
        if bool((runs == runs[:, :1]).all()):
            return runs[:, 0].contiguous()
    return shared
