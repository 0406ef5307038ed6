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
model's own modules (``encode``, the target embedding, the decoder stack, the output projection), so the
exported computation is qkv's, not a copy of it.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.multihead import KVCache, MultiHeadAttention
from qkv.data.tokenizer import Tokenizer
from qkv.export.output import building_export
from qkv.export.output import check_output_folder as check_export_folder
from qkv.inference.kinds import SEQ2SEQ
from qkv.inference.onnx_runtime import MANIFEST_FORMAT, OnnxTranslator
from qkv.inference.runs import load_run
from qkv.models.transformer import EncoderOutput, Transformer

OPSET = 18  # ONNX opset of both graphs (onnxruntime 1.16+ runs it)
EXTRA_LEN = 50  # tokens beyond the source length before a sentence stops: greedy_decode's default

CHECK_TOL = 1e-4  # largest difference from the model an export may show on its tracing inputs

__all__ = ["MANIFEST_FORMAT", "OnnxTranslator", "export_onnx"]


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
        """Encode ``src`` and project the cross-attention keys and values of every decoder layer.

        Args:
            src: ``(b, s_src)`` source ids.

        Returns:
            The memory ``(b, s_src, d)``, then per decoder layer its cross-attention key and value,
            ``(b, h, s_src, d_h)`` each.
        """
        memory = self.model.encode(src).hidden  # (b, s_src, d)
        outputs = [memory]
        for layer in self.model.decoder.layers:
            attn = layer.cross_attn
            assert isinstance(attn, MultiHeadAttention)  # for mypy: ModuleList items are untyped
            outputs += [_heads(attn, attn.k_proj(memory)), _heads(attn, attn.v_proj(memory))]
        return tuple(outputs)


class DecoderStepGraph(nn.Module):
    """What decoder_step.onnx computes: one step of :meth:`Transformer.decode` with the cache passed as
    flat tensors (ONNX graphs take tensors, not :class:`KVCache` objects)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.num_layers = len(model.decoder.layers)

    def forward(self, token: Tensor, src_mask: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        """Decode one step from flat cache tensors.

        Args:
            token: ``(b, 1)`` the last decoded id.
            src_mask: ``(b, s_src)`` True = real source token.
            *caches: every layer's self-attention key and value ``(b, h, t, d_h)``, then every
                layer's cross-attention key and value ``(b, h, s_src, d_h)``, in :func:`cache_names`
                order.

        Returns:
            The next token's logits ``(b, V)``, then every layer's new self-attention key and value,
            ``(b, h, t + 1, d_h)`` each.
        """
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


def _example_inputs(model: Transformer) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Inputs to trace the graphs with: two sentences (one padded), three tokens already decoded.
    Every dynamic size is at least 2 so that the exporter does not take it for a constant 1."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    high = min(config.src_vocab_size, config.tgt_vocab_size)
    src = torch.randint(4, high, (2, 5), generator=generator)
    src[1, 3:] = config.pad_id
    token = torch.randint(4, high, (2, 1), generator=generator)
    with torch.no_grad():
        cross = list(EncoderGraph(model)(src)[1:])
    heads, head_dim = config.num_heads, config.d_model // config.num_heads
    past = [torch.randn(2, heads, 3, head_dim, generator=generator) for _ in cross]
    return src, token, past, cross


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """Silence what the exporter says while it works: its registry's notes on optional packages
    (torchvision), the optimizer's per-pass info lines and its own deprecation warnings, none of
    which the user can act on. Its errors still raise."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        try:
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def write_graph(
    module: nn.Module,
    args: tuple[Any, ...],
    path: Path,
    names: dict[str, list[str]],
    dynamic_shapes: Any,
    *,
    optimize: bool = True,
) -> None:
    """``module`` (in eval mode) written to ``path`` as one ONNX file by PyTorch's dynamo-based
    exporter at :data:`OPSET`, with ``names["inputs"]`` and ``names["outputs"]``, the exporter
    quiet (:func:`quiet_exporter`). ``optimize=False`` keeps the initializers under the module's
    parameter names and layouts."""
    with quiet_exporter():
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            input_names=names["inputs"],
            output_names=names["outputs"],
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            verbose=False,
            optimize=optimize,
        )


def _export_graphs(model: Transformer, folder: Path) -> dict[str, dict[str, list[str]]]:
    """Write encoder.onnx and decoder_step.onnx into ``folder``; returns their input/output names."""
    from torch.export import Dim

    n = len(model.decoder.layers)
    max_len = model.config.max_len
    batch = Dim("batch", min=1)
    src_len = Dim("src_len", min=1, max=max_len)
    past = Dim("past", min=0, max=max_len - 2)  # the last step's input holds max_len - 2 tokens
    src, token, self_kv, cross_kv = _example_inputs(model)
    names = {
        "encoder": {"inputs": ["src"], "outputs": ["memory", *cache_names(n, "cross_")]},
        "decoder_step": {
            "inputs": ["token", "src_mask", *cache_names(n, "self_"), *cache_names(n, "cross_")],
            "outputs": ["logits", *cache_names(n, "new_self_")],
        },
    }
    cache_shapes = tuple([{0: batch, 2: past}] * (2 * n) + [{0: batch, 2: src_len}] * (2 * n))
    exports: list[tuple[nn.Module, tuple[Any, ...], Any, str]] = [
        (EncoderGraph(model), (src,), {"src": {0: batch, 1: src_len}}, "encoder"),
        (
            DecoderStepGraph(model),
            (token, src != model.config.pad_id, *self_kv, *cross_kv),
            ({0: batch}, {0: batch, 1: src_len}, cache_shapes),
            "decoder_step",
        ),
    ]
    for module, args, dynamic_shapes, name in exports:
        write_graph(module, args, folder / f"{name}.onnx", names[name], dynamic_shapes)
    return names


def _check_graphs(model: Transformer, folder: Path) -> float:
    """Run both graphs with onnxruntime on the tracing inputs and compare them with the model (encoder
    output, cross-attention keys/values, a step's logits and cache): ``ValueError`` beyond
    :data:`CHECK_TOL`, so that an export that does not compute the model is never put in place.
    Returns the largest difference."""
    translator = OnnxTranslator(folder, threads=1)
    src, token, self_kv, cross_kv = _example_inputs(model)
    src_mask = src != model.config.pad_id
    with torch.no_grad():
        expected = [*EncoderGraph(model)(src), *DecoderStepGraph(model)(token, src_mask, *self_kv, *cross_kv)]
    logits, new_self = translator.step(
        token.numpy(), src_mask.numpy(), [t.numpy() for t in self_kv], [t.numpy() for t in cross_kv]
    )
    got = [*translator.encode(src.numpy()), logits, *new_self]
    worst = max(float(abs(torch.from_numpy(a) - b).max()) for a, b in zip(got, expected, strict=True))
    if not worst <= CHECK_TOL:  # NaN fails too
        raise ValueError(f"the ONNX graphs differ from the model by {worst:.2e} (> {CHECK_TOL}); nothing written")
    return worst


def check_output_folder(out: str | Path, *, overwrite: bool, run_dir: str | Path | None = None) -> Path:
    """``out`` must not exist, be empty, or (with ``overwrite``) hold an earlier ONNX export and nothing
    else (:func:`qkv.export.output.check_output_folder`). Returns the path to build at."""
    return check_export_folder(out, overwrite=overwrite, kind="onnx", run_dir=run_dir)


def export_onnx(run_dir: str | Path, out: str | Path, *, weights: str = "model", overwrite: bool = False) -> Path:
    """Export a translation run to ONNX for greedy decoding with onnxruntime (:class:`OnnxTranslator`).

    Args:
        run_dir: a translation run folder.
        out: the folder to write (see the module's docstring for its files): it must not exist or be
            empty, unless ``overwrite`` replaces an earlier ONNX export there.
        weights: which of the run's weights: ``model`` (averaged/final), ``best``, ``last`` or ``ema``.
        overwrite: replace an earlier ONNX export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: ``run_dir`` is a language-model run, or ``out`` may not be written.
        PermissionError: ``out`` cannot be written (checked before any work).
        FileNotFoundError: ``run_dir`` is not a run folder, or lacks the weights.
    """
    from qkv.runtime.fileio import write_json

    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, _ = load_run(run_dir, weights, task=SEQ2SEQ.name)
    assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # a translation run's, load_run checked
    model = model.float().eval()
    with building_export(target, kind="onnx", tag="onnx") as tmp:
        names = _export_graphs(model, tmp)
        shutil.copyfile(Path(run_dir) / "tokenizer.json", tmp / "tokenizer.json")
        config = model.config
        manifest = {
            "qkv_onnx": MANIFEST_FORMAT,
            "opset": OPSET,
            "pad_id": config.pad_id,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            "max_len": config.max_len,  # positions the model covers: source ids (EOS included) and decoded ones
            "extra_len": EXTRA_LEN,
            "num_layers": len(model.decoder.layers),
            "num_heads": config.num_heads,
            "head_dim": config.d_model // config.num_heads,
            "tgt_vocab_size": config.tgt_vocab_size,
            "files": {"encoder": "encoder.onnx", "decoder_step": "decoder_step.onnx", "tokenizer": "tokenizer.json"},
            **names,
        }
        write_json(tmp / "manifest.json", manifest)
        _check_graphs(model, tmp)
    return out
