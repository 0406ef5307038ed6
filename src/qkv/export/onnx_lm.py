"""``qkv export RUN --to onnx OUT`` for a language-model run: one ONNX graph that steps the model with its cache.

``export_onnx_lm(run_dir, out)`` writes into ``out``::

    decoder_step.onnx  ids (b, s_new) int64 and, per layer i, past_key_i / past_value_i
                       (b, h_kv, past, d_h) float32 (past = 0 on the first call) -> logits (b, V) of
                       the last position and new_key_i / new_value_i (b, h_kv, past + s_new, d_h)
    manifest.json      the graph's input and output names, layers, key/value heads, head dim,
                       vocabulary, context and the tokenizer's special ids (:data:`MANIFEST_FORMAT`)
    tokenizer.json     the run's tokenizer, as it is

A prompt goes through the graph at once with an empty cache, then one token at a time
(:func:`onnx_greedy`). The graph is made by PyTorch's dynamo-based exporter from a wrapper
(:class:`LMStepGraph`) that calls the model's own modules with the cache passed as flat tensors, the
positions starting at ``past``, and the causal mask built bottom-right aligned, so the exported
computation is qkv's. Before the folder is put in place, onnxruntime's greedy generations on fixed
prompts must be :meth:`~qkv.models.causal_lm.CausalLM.generate`'s with ``temperature=0`` (up to
near-ties, :func:`qkv.export.ctranslate2_lm.same_up_to_ties`).

A sliding window is held by the mask, not by trimming: the graph takes and returns the whole cache
(qkv's attention keeps only the window's last keys, a length the graph's symbolic cache size could
not follow) and each windowed layer's query sees only its last ``window`` keys, which gives the same
attention. Every other part of today's models (rotary and its scalings, ALiBi, RMSNorm, gated
feed-forwards, grouped-query heads, QK-norm, soft-capping) is computed by qkv's own modules, so
nothing is refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.attention.multihead import KVCache
from qkv.export.onnx import OPSET, cache_names, check_output_folder, write_graph
from qkv.export.output import building_export
from qkv.inference.kinds import CAUSAL_LM
from qkv.inference.runs import open_run
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.runtime.fileio import write_json

MANIFEST_FORMAT = 1  # the manifest's "qkv_onnx_lm" value; raise it when the graph's interface changes
CHECK_PROMPTS = 8  # prompts of the greedy check an export runs on its folder
CHECK_PROMPT_LEN = 5
CHECK_NEW_TOKENS = 12

__all__ = ["MANIFEST_FORMAT", "LMStepGraph", "check_lm_onnx", "export_onnx_lm", "onnx_greedy", "write_lm_onnx"]


def _kv_shape(config: CausalLMConfig) -> tuple[int, int]:
    """``(h_kv, d_h)``: the key/value heads and the head dim of the cache."""
    return config.num_kv_heads or config.num_heads, config.d_model // config.num_heads


class LMStepGraph(nn.Module):
    """What decoder_step.onnx computes: :meth:`CausalLM.forward` over new ids with the cache passed as
    flat tensors (ONNX graphs take tensors, not :class:`KVCache` objects), the last position's logits."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        """Run the new ids after the cached ones.

        Args:
            ids: ``(b, s_new)`` the new token ids.
            *past: every layer's key and value ``(b, h_kv, past, d_h)``, in :func:`cache_names` order.

        Returns:
            The last position's logits ``(b, V)``, then every layer's new key and value
            ``(b, h_kv, past + s_new, d_h)``.
        """
        model = self.model
        # the position of the first new id: size() stays symbolic in the graph (len() would freeze it)
        start = past[0].size(-2)
        s_new = ids.size(1)
        # what CausalLM.forward checks, told to the exporter so that the positional table's check holds
        torch._check(start + s_new <= model.config.context)
        x = model.positional(model.token_embedding(ids) * model.embed_scale, start)  # (b, s_new, d)
        # the causal mask, bottom-right aligned: new query i (at position start + i) sees keys 0 ..
        # start + i, and with a window only the last `window` of them. Given explicitly, so that no
        # branch depends on s_new (the attention's one-query shortcut, its window's size test)
        query_at = torch.arange(s_new, device=ids.device)[:, None] + start  # (s_new, 1)
        distance = query_at - torch.arange(start + s_new, device=ids.device)[None, :]  # (s_new, past + s_new)
        new: list[Tensor] = []
        layers: list[Any] = list(model.decoder.layers)  # EncoderLayer modules (their sub-modules typed loosely)
        windows = [layer.self_attn.window for layer in layers]
        try:
            for layer in layers:
                # the window is in the mask; without it on the module, the attention keeps its whole
                # cache (no trimming to the window, whose length the graph could not follow)
                layer.self_attn.window = None
            for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
                mask = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
                out = layer(x, attn_mask=mask, cache=KVCache(past[2 * i], past[2 * i + 1]))
                x = out.output
                new += [out.self_cache.key, out.self_cache.value]
        finally:
            for layer, window in zip(layers, windows, strict=True):
                layer.self_attn.window = window
        if model.decoder.norm is not None:
            x = model.decoder.norm(x)
        return (model.logits(x[:, -1]), *new)


def _example_inputs(model: CausalLM) -> tuple[Tensor, list[Tensor]]:
    """Inputs to trace the graph with: two rows of three new ids after three cached ones. Every dynamic
    size is at least 2 so that the exporter does not take it for a constant 1."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 3), generator=generator)
    heads, head_dim = _kv_shape(config)
    past = [torch.randn(2, heads, 3, head_dim, generator=generator) for _ in range(2 * config.num_layers)]
    return ids, past


def _names(num_layers: int) -> dict[str, list[str]]:
    return {
        "inputs": ["ids", *cache_names(num_layers, "past_")],
        "outputs": ["logits", *cache_names(num_layers, "new_")],
    }


def _export_graph(model: CausalLM, folder: Path) -> dict[str, list[str]]:
    """Write decoder_step.onnx into ``folder``; returns its input/output names."""
    from torch.export import Dim

    context = model.config.context
    batch = Dim("batch", min=1)
    new = Dim("new", min=1, max=context)
    past = Dim("past", min=0, max=context - 1)
    ids, past_kv = _example_inputs(model)
    names = _names(model.config.num_layers)
    shapes = ({0: batch, 1: new}, tuple([{0: batch, 2: past}] * len(past_kv)))
    write_graph(LMStepGraph(model), (ids, *past_kv), folder / "decoder_step.onnx", names, shapes)
    return names


def onnx_greedy(session: Any, manifest: dict[str, Any], prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
    """The ``new`` ids onnxruntime's greedy search adds to each prompt over decoder_step.onnx: the
    prompt at once with an empty cache, then one token at a time (no stop at an end token, as qkv's
    generation).

    Args:
        session: an ``onnxruntime.InferenceSession`` of decoder_step.onnx.
        manifest: the folder's manifest.json.
        prompts: token ids, at least one each.
        new: tokens to add; prompt and continuation must fit the context.

    Returns:
        The new ids of each prompt, in the order given.

    Raises:
        ValueError: a prompt is empty or a continuation would pass the context.
    """
    inputs, outputs = manifest["decoder_step"]["inputs"], manifest["decoder_step"]["outputs"]
    heads, head_dim = manifest["num_kv_heads"], manifest["head_dim"]
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        if not prompt or len(prompt) + new - 1 > manifest["context"]:
            raise ValueError(f"prompt of {len(prompt)} ids + {new} new does not fit the context {manifest['context']}")
        by_length.setdefault(len(prompt), []).append(i)
    for rows in by_length.values():  # one batch per prompt length
        ids = np.array([prompts[i] for i in rows], dtype=np.int64)
        past = [np.zeros((len(rows), heads, 0, head_dim), dtype=np.float32) for _ in inputs[1:]]
        tokens: list[np.ndarray] = []
        for step in range(new):
            logits, *past = session.run(outputs, dict(zip(inputs, [ids, *past], strict=True)))
            token = logits.argmax(-1)  # the first of equal maxima, as torch's argmax
            tokens.append(token)
            if step + 1 < new:
                ids = token[:, None].astype(np.int64)
        for k, i in enumerate(rows):
            out[i] = [int(t[k]) for t in tokens]
    return out


def _session(folder: Path, threads: int | None = 1) -> tuple[Any, dict[str, Any]]:
    from qkv.inference.onnx_runtime import import_onnxruntime
    from qkv.runtime.fileio import read_json

    ort = import_onnxruntime()
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / "decoder_step.onnx"), options, providers=["CPUExecutionProvider"])
    return session, read_json(folder / "manifest.json")


def check_lm_onnx(model: CausalLM, folder: Path) -> None:
    """onnxruntime's greedy generations over ``folder`` must be ``model``'s on :data:`CHECK_PROMPTS`
    fixed prompts (with a sliding window, longer than it), up to near-ties (:func:`~qkv.export.ctranslate2_lm.same_up_to_ties`).

    Args:
        model: the language model, float32, eval mode.
        folder: the folder written so far (decoder_step.onnx and manifest.json).

    Raises:
        ValueError: the generations differ.
    """
    from qkv.export.ctranslate2_lm import same_up_to_ties

    config = model.config
    window = config.sliding_window  # prompt and continuation longer than a window, so that it matters
    length = min(CHECK_PROMPT_LEN if window is None else window + 1, config.context - 1)
    new = min(CHECK_NEW_TOKENS + (window or 0), config.context - length + 1)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (CHECK_PROMPTS, length), generator=generator)
    with torch.no_grad():
        expected = model.generate(prompts, new, temperature=0)[:, length:].tolist()
    session, manifest = _session(folder)
    got = onnx_greedy(session, manifest, prompts.tolist(), new)
    for prompt, mine, other in zip(prompts.tolist(), expected, got, strict=True):
        if not same_up_to_ties(model, prompt, mine, other):
            raise ValueError("the ONNX graph's greedy generations differ from the run's; nothing written")


def write_lm_onnx(model: CausalLM, tokenizer: Any, folder: Path) -> None:
    """Export ``model`` (float32, eval mode) into ``folder``: decoder_step.onnx and manifest.json; the
    caller adds tokenizer.json.

    Args:
        model: the language model.
        tokenizer: the run's tokenizer (its special ids go in the manifest; a character one has none).
        folder: an existing, empty folder.
    """
    config = model.config
    names = _export_graph(model, folder)
    heads, head_dim = _kv_shape(config)
    manifest = {
        "qkv_onnx_lm": MANIFEST_FORMAT,
        "opset": OPSET,
        "num_layers": config.num_layers,
        "num_kv_heads": heads,
        "head_dim": head_dim,
        "vocab_size": config.vocab_size,
        "context": config.context,
        **{f"{name}_id": getattr(tokenizer, f"{name}_id", None) for name in ("pad", "bos", "eos", "unk")},
        "files": {"decoder_step": "decoder_step.onnx", "tokenizer": "tokenizer.json"},
        "decoder_step": names,
    }
    write_json(folder / "manifest.json", manifest)


def export_onnx_lm(run_dir: str | Path, out: str | Path, *, weights: str = "model", overwrite: bool = False) -> Path:
    """Export a language-model run to ONNX for greedy generation with onnxruntime (:func:`onnx_greedy`).

    Args:
        run_dir: a language-model run folder.
        out: the folder to write (see the module's docstring for its files): it must not exist or be
            empty, unless ``overwrite`` replaces an earlier ONNX export there.
        weights: which of the run's weights: ``model`` (averaged/final), ``best``, ``last`` or ``ema``.
        overwrite: replace an earlier ONNX export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: a translation run, generations that differ from the run's, or ``out`` is taken.
        PermissionError: ``out`` cannot be written (checked before any work).
        FileNotFoundError: ``run_dir`` is not a run folder, or lacks the weights.
    """
    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, _ = open_run(run_dir, weights, task=CAUSAL_LM.name)
    assert isinstance(model, CausalLM)  # a language-model run's, open_run checked
    model = model.float().eval()
    with building_export(target, kind="onnx", tag="onnx") as tmp:
        write_lm_onnx(model, tokenizer, tmp)
        shutil.copyfile(Path(run_dir) / "tokenizer.json", tmp / "tokenizer.json")
        check_lm_onnx(model, tmp)
    return out
