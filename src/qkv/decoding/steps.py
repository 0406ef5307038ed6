"""The decoder's steps as greedy decoding and beam search drive them: ids so far in, next-token logits out.

:func:`decoder_steps` gives one of two implementations of the same steps:

* :class:`PlainSteps` calls :meth:`Transformer.decode` (or an :class:`Ensemble`'s) with its KV cache,
  or without one (``use_cache=False``: the whole prefix again every step, the slow reference).
* :class:`FastSteps`, for a plain float32 :class:`Transformer` on CPU outside autocast, computes the
  same layers for the one new position with less around them: the weights packed once for oneDNN
  (:mod:`qkv.decoding.packed_linear`: every one with AVX512, the vocabulary projection's with AVX2), the
  self-attention's three projections and the cross-attention's key/value projections each one
  product, the memory's padding mask built once (as the scores' addend), the memory kept once for a
  sentence's beams (they attend to it as that many queries), and no module calls, shape checks or
  output records per step. It is inference only and knows only qkv's own layers: a model with
  anything else in its decoder (a subclass, a hook that records a layer, an attention backend forced
  by :func:`qkv.attention.backends.use_backend`) gets :class:`PlainSteps`.
  tests/test_decoding_speedpath.py holds the two to the same logits.

:func:`encode` is the encoder's pass the same way: ``model.encode``'s memory, through packed products
where FastSteps would apply.

Shape legend: ``b`` rows (sentences, times the beam), ``t`` decoded length, ``d`` d_model, ``h``
heads, ``d_h`` head size, ``s_src`` source length, ``V`` target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import backends
from qkv.attention.multihead import KVCache, MultiHeadAttention
from qkv.decoding.ensemble import Ensemble
from qkv.decoding.packed_linear import PackedLinear, fuse
from qkv.models.transformer import EncoderOutput, Transformer
from qkv.nn.layers import DecoderLayer, EncoderLayer, FeedForward
from qkv.runtime.padded_linear import Linear

FAST = True  # False: always PlainSteps (to compare the two)


class Steps(Protocol):
    """A decoding call's steps: ``steps(tokens)`` with the ids so far, ``(b, t)`` BOS first, gives
    the logits of the next token, ``(b, V)``; ``steps.select(index, memory_index)`` keeps the rows
    ``index`` (in that order, repeats allowed) and the memory's rows ``memory_index`` (None: as
    they are; the memory does not depend on the decoded prefix, so beam search reorders it only when
    a sentence leaves)."""

    def __call__(self, tokens: Tensor) -> Tensor: ...

    def select(self, index: Tensor, memory_index: Tensor | None) -> None: ...


class PlainSteps:
    """Steps through ``model.decode``, keeping its KV cache (none when ``use_cache`` is False)."""

    def __init__(self, model: Transformer | Ensemble, memory: EncoderOutput, use_cache: bool = True) -> None:
        self.model, self.memory, self.use_cache = model, memory, use_cache
        self.cache: list[tuple[KVCache, KVCache]] | None = None

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens (b, t)``, BOS first -> the logits of the token after them, ``(b, V)``."""
        out = self.model.decode(tokens if self.cache is None else tokens[:, -1:], self.memory, cache=self.cache)
        if self.use_cache:
            self.cache = out.cache
        assert out.logits is not None  # decode projects unless told not to
        return out.logits[:, -1]

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        if memory_index is not None:
            hidden, mask = self.memory.hidden.index_select(0, memory_index), self.memory.key_padding_mask
            self.memory = EncoderOutput(hidden, None, None if mask is None else mask.index_select(0, memory_index))
        if self.cache is not None:
            self.cache = [
                (own.index_select(index), cross if memory_index is None else cross.index_select(memory_index))
                for own, cross in self.cache
            ]


def decoder_steps(model: Transformer | Ensemble, memory: EncoderOutput, use_cache: bool = True) -> Steps:
    """The fastest implementation of ``model``'s decoding steps that applies (see the module's docstring)."""
    if FAST and use_cache and isinstance(model, Transformer) and fast_steps_apply(model, memory):
        return FastSteps(model, memory)
    return PlainSteps(model, memory, use_cache)


def fast_steps_apply(model: Transformer, memory: EncoderOutput) -> bool:
    """Whether :class:`FastSteps` computes what ``model.decode`` would: qkv's own decoder layers, no
    hooks, float32 on CPU, eval mode, no autocast and no forced attention backend."""
    if memory.hidden.dtype != torch.float32 or memory.key_padding_mask is None:
        return False
    if not _fast_path_applies(model, [model.tgt_embed, model.decoder, model.output_proj]):
        return False
    return type(model.output_proj) in (nn.Linear, Linear) and all(_plain_layer(m) for m in model.decoder.layers)


def fast_encoder_applies(model: Transformer) -> bool:
    """Whether :func:`encode` computes what ``model.encode`` would by the fast path: as
    :func:`fast_steps_apply`, for the encoder's layers."""
    return _fast_path_applies(model, [model.src_embed, model.encoder]) and all(
        _plain_layer(m) for m in model.encoder.layers
    )


def _fast_path_applies(model: Transformer, parts: list[nn.Module]) -> bool:
    """A plain float32 :class:`Transformer` on CPU in eval mode, outside autocast, with no forced attention
    backend and no hook on ``parts`` (or on every module)."""
    weight = model.output_proj.weight
    if type(model) is not Transformer or model.training or weight.device.type != "cpu":
        return False
    if weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu") or backends.forced_backend() != "auto":
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for part in parts for m in part.modules())


def _plain_layer(layer: nn.Module) -> bool:
    """qkv's own encoder or decoder layer, built of its own attention, plain linear layers and layer norms."""
    attentions: tuple[nn.Module, ...]
    norms: tuple[nn.Module, ...]
    if type(layer) is DecoderLayer:
        attentions, norms = (layer.self_attn, layer.cross_attn), (layer.norm1, layer.norm2, layer.norm3)
    elif type(layer) is EncoderLayer:
        attentions, norms = (layer.self_attn,), (layer.norm1, layer.norm2)
    else:
        return False
    if type(layer.feed_forward) is not FeedForward:
        return False
    linears = [getattr(a, n) for a in attentions for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    linears += [layer.feed_forward.linear1, layer.feed_forward.linear2]
    return (
        all(type(a) is MultiHeadAttention and a.kdim == a.vdim == a.embed_dim for a in attentions)
        and all(type(m) in (nn.Linear, Linear) for m in linears)
        and all(type(n) is nn.LayerNorm for n in norms)
    )


def encode(model: Transformer | Ensemble, src: Tensor) -> EncoderOutput:
    """``model.encode(src)`` for decoding: ``src (b, s_src)`` padded ids -> the memory (no attention
    weights). Where :func:`fast_encoder_applies`, the encoder's layers are computed as :class:`FastSteps`
    computes the decoder's: every product through :class:`PackedLinear` (the self-attention's three as
    one), the feed-forward network's activation in its first product, the padding mask built once as the
    scores' addend, no module calls per layer."""
    if not (FAST and isinstance(model, Transformer) and fast_encoder_applies(model)):
        return model.encode(src)
    real = src != model.config.pad_id  # (b, s_src) True = a real source token
    addend = _scores_addend(real)
    x = model.src_embed(src)  # (b, s_src, d)
    b, s, d = x.shape
    flat = x.reshape(b * s, d)
    for layer in model.encoder.layers:
        flat = _encoder_layer(layer, flat, b, s, addend)  # type: ignore[arg-type]
    if model.encoder.norm is not None:
        flat = model.encoder.norm(flat)
    return EncoderOutput(flat.view(b, s, d), None, real)


def _encoder_layer(layer: EncoderLayer, x: Tensor, b: int, s: int, addend: Tensor) -> Tensor:
    """One :class:`EncoderLayer` (eval mode) over ``x (b * s, d)``, ``addend (b, 1, 1, s)``."""
    sa, ff = layer.self_attn, layer.feed_forward
    heads, head_dim = sa.num_heads, sa.head_dim
    qkv = fuse(*((p.weight, p.bias) for p in (sa.q_proj, sa.k_proj, sa.v_proj)))
    out = PackedLinear(sa.out_proj.weight, sa.out_proj.bias)
    ff1 = PackedLinear(ff.linear1.weight, ff.linear1.bias, activation=ff.activation)  # act(x W_1 + b_1)
    ff2 = PackedLinear(ff.linear2.weight, ff.linear2.bias)
    norm1, norm2 = _layer_norm(layer.norm1), _layer_norm(layer.norm2)

    def attend(h: Tensor) -> Tensor:
        q, k, v = qkv(h).view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # (b, h, s, d_h) each
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=addend)  # (b, h, s, d_h)
        return out(attended.transpose(1, 2).reshape(b * s, heads * head_dim))

    if layer.norm_first:
        x = x + attend(norm1(x))
        return x + ff2(ff1(norm2(x)))
    x = norm1(x + attend(x))
    return norm2(x + ff2(ff1(x)))


def _scores_addend(real: Tensor) -> Tensor:
    """``real (b, s_src)``, True at a real source token -> ``(b, 1, 1, s_src)`` float32 added to the
    attention scores: 0 at a real token, -inf at padding (attention would build this from a boolean mask
    on every call)."""
    return torch.zeros(real.shape, dtype=torch.float32).masked_fill_(~real, float("-inf"))[:, None, None, :]


def _layer_norm(norm: nn.LayerNorm) -> Callable[[Tensor], Tensor]:
    shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
    return lambda x: F.layer_norm(x, shape, weight, bias, eps)


class _FastLayer:
    """One :class:`DecoderLayer` for one new position, ``x (b, d)``, with its caches: its own keys and
    values so far ``(b, h, t, d_h)`` and the memory's ``(b, h, s_src, d_h)``."""

    def __init__(self, layer: DecoderLayer, memory: Tensor, mask: Tensor) -> None:
        sa, ca, ff = layer.self_attn, layer.cross_attn, layer.feed_forward
        self.heads, self.head_dim, self.norm_first = sa.num_heads, sa.head_dim, layer.norm_first
        self.norms = [_layer_norm(n) for n in (layer.norm1, layer.norm2, layer.norm3)]
        self.qkv = fuse(*((p.weight, p.bias) for p in (sa.q_proj, sa.k_proj, sa.v_proj)))
        self.self_out = PackedLinear(sa.out_proj.weight, sa.out_proj.bias)
        self.cross_q = PackedLinear(ca.q_proj.weight, ca.q_proj.bias)
        self.cross_out = PackedLinear(ca.out_proj.weight, ca.out_proj.bias)
        self.ff1 = PackedLinear(ff.linear1.weight, ff.linear1.bias, activation=ff.activation)  # act(x W_1 + b_1)
        self.ff2 = PackedLinear(ff.linear2.weight, ff.linear2.bias)
        b, s, d = memory.shape
        kv = fuse((ca.k_proj.weight, ca.k_proj.bias), (ca.v_proj.weight, ca.v_proj.bias))(memory.reshape(b * s, d))
        self.cross_key, self.cross_value = kv.view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        self.mask = mask  # (b, 1, 1, s_src) added to the scores: 0 at a real source token, -inf at padding
        self.key: Tensor | None = None  # (b, h, t, d_h) this layer's own keys so far
        self.value: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        norm1, norm2, norm3 = self.norms
        if self.norm_first:
            x = x + self._self_attend(norm1(x))
            x = x + self._cross_attend(norm2(x))
            return x + self.ff2(self.ff1(norm3(x)))
        x = norm1(x + self._self_attend(x))
        x = norm2(x + self._cross_attend(x))
        return norm3(x + self.ff2(self.ff1(x)))

    def _self_attend(self, x: Tensor) -> Tensor:
        b = x.size(0)
        q, k, v = self.qkv(x).view(b, 3, self.heads, 1, self.head_dim).unbind(1)  # (b, h, 1, d_h) each
        if self.key is not None and self.value is not None:
            k, v = torch.cat([self.key, k], dim=2), torch.cat([self.value, v], dim=2)  # (b, h, t, d_h)
        self.key, self.value = k, v
        return self.self_out(F.scaled_dot_product_attention(q, k, v).view(b, -1))  # the new query sees every key

    def _cross_attend(self, x: Tensor) -> Tensor:
        b, m = x.size(0), self.cross_key.size(0)
        if b == m:  # a memory row per row
            q = self.cross_q(x).view(b, self.heads, 1, self.head_dim)
            out = F.scaled_dot_product_attention(q, self.cross_key, self.cross_value, attn_mask=self.mask)
            return self.cross_out(out.view(b, -1))
        # g = b / m consecutive rows (a sentence's beams) share a memory row: they are its g queries
        q = self.cross_q(x).view(m, b // m, self.heads, self.head_dim).transpose(1, 2)  # (m, h, g, d_h)
        out = F.scaled_dot_product_attention(q, self.cross_key, self.cross_value, attn_mask=self.mask)
        return self.cross_out(out.transpose(1, 2).reshape(b, -1))

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        """Rows ``index`` of the self-attention's keys and values; memory rows ``memory_index`` (in
        :class:`FastSteps`' memory's own rows, which a group of rows may share)."""
        if self.key is not None and self.value is not None:
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
        if memory_index is not None:
            self.cross_key = self.cross_key.index_select(0, memory_index)
            self.cross_value = self.cross_value.index_select(0, memory_index)
            self.mask = self.mask.index_select(0, memory_index)


class FastSteps:
    """:class:`PlainSteps`'s steps for a plain float32 :class:`Transformer` on CPU, computed by
    :class:`_FastLayer` s with packed weights (see the module's docstring). Built per decoding call:
    the packed weights are the model's weights of that moment."""

    def __init__(self, model: Transformer, memory: EncoderOutput) -> None:
        assert memory.key_padding_mask is not None  # fast_steps_apply checked it
        # the memory's padding as the scores' addend, built once: given a boolean mask, attention would
        # build this on every call
        mask = _scores_addend(memory.key_padding_mask)
        self.layers = [_FastLayer(layer, memory.hidden, mask) for layer in model.decoder.layers]  # type: ignore[arg-type]
        self.embed, self.final_norm = model.tgt_embed, model.decoder.norm
        self.project = PackedLinear(model.output_proj.weight, model.output_proj.bias)
        self.length = 0  # positions decoded so far
        self.rows = memory.hidden.size(0)  # rows decoded: a multiple of the memory's rows kept (see select)

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.length == 0 and tokens.size(1) != 1:  # a prefix to start from: the plain path reads it
            raise ValueError("FastSteps starts from BOS alone")
        x = self.embed(tokens[:, -1:], self.length)[:, 0]  # (b, d)
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        self.length += 1
        return self.project(x)  # (b, V)

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        """As :meth:`Steps.select`. The memory is kept once per group of consecutive rows that share it
        (a sentence's beams: ``memory_index`` repeating each of its values ``g`` times in a row), and its
        keys and values are not copied ``g`` times: each group's rows attend to them as ``g`` queries."""
        if memory_index is not None:
            group = self.rows // self.layers[0].cross_key.size(0)  # rows a kept memory row serves now
            memory_index = _runs(memory_index // group)  # (the kept memory row each new row reads)
        self.rows = index.numel()
        for layer in self.layers:
            layer.select(index, memory_index)


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
