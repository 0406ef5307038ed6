"""Export a language model to ONNX with its attention weights as outputs: the graph the docs' live page runs.

``export_onnx_attention(run_dir, out)`` writes into ``out``::

    attention.onnx  ids (b, s) int64 -> logits (b, V) of the last position and, per layer i,
                    attention_i (b, h, s, s): layer i's causal self-attention weights (row = query,
                    column = key; each row sums to 1, zero above the diagonal)
    manifest.json   the graph's input and output names, the model's config, the tokenizer's
                    characters (a character tokenizer) and the run it came from
                    (:data:`MANIFEST_FORMAT`)
    tokenizer.json  the run's tokenizer, as it is

Unlike ``decoder_step.onnx`` of :mod:`qkv.export.onnx_lm` (made for generation: a cache, no weights),
this graph reads a whole text at once, the way ``qkv attend`` does, and returns what the explorer shows.
The graph is made by PyTorch's dynamo-based exporter from :class:`LMAttentionGraph`, which calls the
model's own modules with the causal mask given explicitly (so that no branch depends on the length),
and before the folder is put in place onnxruntime's weights and logits must be the model's
(:meth:`~qkv.models.causal_lm.CausalLM.forward` with ``need_weights=True``) within :data:`CHECK_TOL`
(:data:`CHECK_TOL_LOGITS` for the logits) at every length from 1 to the context.

The docs' live page runs such a folder, ``web/live-model`` (web/README.md says how it was made).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.export.onnx import OPSET, check_output_folder, write_graph
from qkv.export.output import building_export
from qkv.inference.kinds import CAUSAL_LM
from qkv.inference.runs import open_run
from qkv.models.causal_lm import CausalLM
from qkv.runtime.fileio import write_json

MANIFEST_FORMAT = 1  # the manifest's "qkv_onnx_attention" value; raise it when the graph's interface changes
GRAPH_FILE = "attention.onnx"
CHECK_TOL = 1e-5  # largest difference from the model's attention weights an export may show
CHECK_TOL_LOGITS = 1e-4  # and from its logits (larger numbers: float32 rounds them more coarsely)
CHECK_SEED = 0  # seed of the random texts the check runs

__all__ = [
    "GRAPH_FILE",
    "MANIFEST_FORMAT",
    "LMAttentionGraph",
    "check_attention_onnx",
    "export_onnx_attention",
    "model_from_onnx",
]


def attention_names(num_layers: int) -> list[str]:
    """``["attention_0", ...]``: one weights output per layer."""
    return [f"attention_{i}" for i in range(num_layers)]


class LMAttentionGraph(nn.Module):
    """What attention.onnx computes: :meth:`CausalLM.forward` over a whole text with ``need_weights=True``,
    the last position's logits and every layer's attention weights."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> tuple[Tensor, ...]:
        """Run the model over ``ids``.

        Args:
            ids: ``(b, s)`` token ids, ``s`` at most the model's context.

        Returns:
            The last position's logits ``(b, V)``, then every layer's weights ``(b, h, s, s)``.
        """
        model = self.model
        s = ids.size(1)
        torch._check(s <= model.config.context)  # what CausalLM.forward checks, told to the exporter
        x = model.positional(model.token_embedding(ids) * model.embed_scale, 0)  # (b, s, d)
        # the causal mask, given explicitly so that no branch depends on s (the one-query shortcut)
        positions = torch.arange(s, device=ids.device)
        distance = positions[:, None] - positions[None, :]  # (s, s): query i - key j
        layers: list[Any] = list(model.decoder.layers)  # EncoderLayer modules (their sub-modules typed loosely)
        weights: list[Tensor] = []
        for layer in layers:
            window = layer.self_attn.window
            mask = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
            out = layer(x, attn_mask=mask, need_weights=True)
            x = out.output
            weights.append(out.self_weights)
        if model.decoder.norm is not None:
            x = model.decoder.norm(x)
        return (model.logits(x[:, -1]), *weights)


def _export_graph(model: CausalLM, path: Path) -> dict[str, list[str]]:
    """Write the graph to ``path``; returns its input and output names."""
    from torch.export import Dim

    config = model.config
    names = {"inputs": ["ids"], "outputs": ["logits", *attention_names(config.num_layers)]}
    ids = torch.randint(0, config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))
    shapes = ({0: Dim("batch", min=1), 1: Dim("seq", min=1, max=config.context)},)
    # unoptimised, so that the initializers keep the model's parameter names and layouts
    # (:func:`state_dict_of`); onnxruntime optimises the graph when it loads it
    write_graph(LMAttentionGraph(model), (ids,), path, names, shapes, optimize=False)
    return names


def model_from_onnx(folder: str | Path) -> CausalLM:
    """The :class:`CausalLM` an export folder holds, rebuilt from its manifest's config and its graph's
    initializers (named as the model's parameters: the graph is written unoptimised), float32, eval mode.

    Args:
        folder: a folder :func:`export_onnx_attention` wrote.

    Returns:
        The model, its parameters the graph's.

    Raises:
        ValueError: the graph lacks one of the model's parameters, or holds one of another shape.
    """
    import onnx
    from onnx import numpy_helper

    from qkv.models.causal_lm import CausalLMConfig
    from qkv.runtime.fileio import read_json

    folder = Path(folder)
    manifest = read_json(folder / "manifest.json")
    model = CausalLM(CausalLMConfig(**manifest["model"])).float().eval()
    graph = onnx.load(str(folder / manifest["files"]["graph"]))
    found = {init.name.removeprefix("model."): numpy_helper.to_array(init) for init in graph.graph.initializer}
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight once, under its first name
            array = found.get(name)
            if array is None and name == "token_embedding.weight":  # tied: written as the output projection's
                array = found.get("output_proj.weight")
            if array is None or tuple(array.shape) != tuple(param.shape):
                raise ValueError(f"{folder}: the graph has no parameter {name} of shape {tuple(param.shape)}")
            param.copy_(torch.from_numpy(array.copy()))
    return model


def check_attention_onnx(model: CausalLM, path: Path) -> dict[str, float]:
    """onnxruntime's logits and weights over the graph at ``path`` must be ``model``'s on a random text
    of every length from 1 to the context.

    Args:
        model: the language model, float32, eval mode.
        path: the graph.

    Returns:
        The largest absolute differences seen: ``{"weights": ..., "logits": ...}``.

    Raises:
        ValueError: weights beyond :data:`CHECK_TOL` or logits beyond :data:`CHECK_TOL_LOGITS` (or NaN).
    """
    from qkv.inference.onnx_runtime import import_onnxruntime

    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    config = model.config
    generator = torch.Generator().manual_seed(CHECK_SEED)
    worst = {"weights": 0.0, "logits": 0.0}
    for length in range(1, config.context + 1):
        ids = torch.randint(0, config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            out = model(ids, need_weights=True)
        assert out.logits is not None and out.attentions is not None  # projected, need_weights
        expected = [out.logits[:, -1], *out.attentions]
        got = session.run(None, {"ids": ids.numpy()})
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            kind = "logits" if i == 0 else "weights"
            worst[kind] = max(worst[kind], float(np.abs(a - b.numpy()).max()))
    for kind, tol in (("weights", CHECK_TOL), ("logits", CHECK_TOL_LOGITS)):
        if not worst[kind] <= tol:  # NaN fails too
            raise ValueError(
                f"the ONNX graph's {kind} differ from the model's by {worst[kind]:.2e} (> {tol}); nothing written"
            )
    return worst


def export_onnx_attention(
    run_dir: str | Path, out: str | Path, *, weights: str = "model", overwrite: bool = False
) -> Path:
    """Export a language-model run to an ONNX graph that returns its attention weights (see the module's
    docstring for the files).

    Args:
        run_dir: a language-model run folder.
        out: the folder to write: it must not exist or be empty, unless ``overwrite`` replaces an earlier
            ONNX export there.
        weights: which of the run's weights: ``model`` (averaged/final), ``best``, ``last`` or ``ema``.
        overwrite: replace an earlier ONNX export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: a translation run, a graph that does not compute the model, or ``out`` is taken.
        FileNotFoundError: ``run_dir`` is not a run folder, or lacks the weights.
    """
    from dataclasses import asdict

    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, _ = open_run(run_dir, weights, task=CAUSAL_LM.name)
    assert isinstance(model, CausalLM)  # a language-model run's, open_run checked
    model = model.float().eval()
    with building_export(target, kind="onnx", tag="onnx") as tmp:
        names = _export_graph(model, tmp / GRAPH_FILE)
        shutil.copyfile(Path(run_dir) / "tokenizer.json", tmp / "tokenizer.json")
        chars = getattr(tokenizer, "chars", None)
        manifest = {
            "qkv_onnx_attention": MANIFEST_FORMAT,
            "opset": OPSET,
            "model": asdict(model.config),
            "chars": "".join(chars) if chars is not None else None,
            "source": {"run": Path(run_dir).name, "weights": weights},
            "files": {"graph": GRAPH_FILE, "tokenizer": "tokenizer.json"},
            **names,
        }
        write_json(tmp / "manifest.json", manifest)
        check_attention_onnx(model, tmp / GRAPH_FILE)
        rebuilt = model_from_onnx(tmp)  # the graph holds every parameter, under its own name
        if any(not torch.equal(a, b) for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values())):
            raise ValueError("the ONNX graph's initializers are not the model's parameters; nothing written")
    return out
