"""Export a translation run to ONNX: an encoder graph and a one-step decoder graph with its KV cache.

``export_onnx(run_dir, out)`` writes into ``out``::

    encoder.onnx       src (b, s_src) int64 -> memory (b, s_src, d) and, per decoder layer i,
                       cross_key_i / cross_value_i (b, h, s_src, d_h): the cross-attention keys and
                       values, projected once per sentence as qkv's greedy decoding does
    decoder_step.onnx  token (b, 1) int64, src_mask (b, s_src) bool (True = real token), per layer
                       self_key_i / self_value_i (b, h, t, d_h) (the t tokens decoded so far; t = 0
                       on the first step) and cross_key_i / cross_value_i -> logits (b, V) and
                       new_self_key_i / new_self_value_i (b, h, t + 1, d_h)
    manifest.json      special ids, the positional table's length, the decoding limit, the graphs'
                       input and output names (:data:`MANIFEST_FORMAT`)
    tokenizer.json     the run's tokenizer, as it is

:class:`OnnxTranslator` decodes greedily over those two graphs with onnxruntime, the way
:func:`qkv.decoding.search.greedy_decode` does over the PyTorch model. Both graphs are made by
PyTorch's dynamo-based exporter (``torch.onnx.export(..., dynamo=True)``) from wrappers that call the
model's own ``encode``/``decode``, so the exported computation is qkv's, not a copy of it.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.attention.multihead import KVCache, MultiHeadAttention
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.translate import length_batches
from qkv.models.transformer import EncoderOutput, Transformer
from qkv.runs.folder import load_run

MANIFEST_FORMAT = 1  # the manifest's "qkv_onnx" value; raise it when the graphs' interface changes
OPSET = 18  # ONNX opset of both graphs (onnxruntime 1.16+ runs it)
EXTRA_LEN = 50  # tokens beyond the source length before a sentence stops: greedy_decode's default


def cache_names(num_layers: int, prefix: str) -> list[str]:
    """``[f"{prefix}key_0", f"{prefix}value_0", ...]``: one key and one value name per layer."""
    return [f"{prefix}{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def _heads(attn: MultiHeadAttention, x: Tensor) -> Tensor:
    """``(b, s, e) -> (b, h, s, d_h)``: the layout of a :class:`KVCache`."""
    b, s, _ = x.shape
    return x.view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)


class EncoderGraph(nn.Module):
    """What encoder.onnx computes: the encoder output and every decoder layer's cross-attention
    keys and values (what qkv's first decoding step puts in its static cache)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src).hidden  # (b, s_src, d)
        outputs = [memory]
        for layer in self.model.decoder.layers:
            attn = layer.cross_attn
            outputs += [_heads(attn, attn.k_proj(memory)), _heads(attn, attn.v_proj(memory))]
        return tuple(outputs)


class DecoderStepGraph(nn.Module):
    """What decoder_step.onnx computes: one greedy step through :meth:`Transformer.decode` with the
    cache passed as flat tensors (ONNX graphs take tensors, not :class:`KVCache` objects)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.num_layers = len(model.decoder.layers)

    def forward(self, token: Tensor, src_mask: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        n = self.num_layers
        self_kv, cross_kv = caches[: 2 * n], caches[2 * n :]
        cache = [
            (
                KVCache(self_kv[2 * i], self_kv[2 * i + 1], static=False),
                KVCache(cross_kv[2 * i], cross_kv[2 * i + 1], static=True),
            )
            for i in range(n)
        ]
        # the memory's hidden states are never read: every layer's cross-attention takes its keys and
        # values from the static cache, so a placeholder stands in for them
        memory = EncoderOutput(cross_kv[0], None, src_mask)
        # Transformer.decode's own body, but for the position: decode reads it with len() of the cache,
        # which makes it a Python int and would freeze the exported graph's cache length; size() stays symbolic
        start = self_kv[0].size(-2)
        x, _, _, new_cache = self.model.decoder(self.model.tgt_embed(token, start), memory, cache=cache)
        new = [t for self_cache, _ in new_cache for t in (self_cache.key, self_cache.value)]
        return (self.model.output_proj(x)[:, -1], *new)
