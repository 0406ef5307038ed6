"""nanoGPT checkpoints (``ckpt.pt`` of Karpathy's nanoGPT ``train.py``) in qkv's own :class:`~qkv.CausalLM`.

nanoGPT's ``GPT`` is GPT-2's layout written with ``nn.Linear``: pre-LN blocks, learned positions,
a final LayerNorm, the output tied to the token embedding, the exact (erf) GELU of ``nn.GELU()``,
``c_attn`` packing the query, key and value projections side by side (split here into
``q_proj``/``k_proj``/``v_proj``), and with ``bias=False`` no bias in any Linear *or* LayerNorm
(qkv's LayerNorms then get zero biases, which computes the same thing). Weights are ``(out, in)``
as in qkv, so nothing is transposed.

``ckpt.pt`` is a pickle; it is read with ``torch.load(weights_only=True)``, which refuses anything
but tensors and plain containers, and such a refusal is one line. nanoGPT's character vocabulary
(its ``meta.pkl``, another pickle) is not read: it is ``sorted(set(text))`` of the whole text
(nanoGPT's ``data/shakespeare_char/prepare.py``), which a caller rebuilds from the text.
No nanoGPT code runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.models.causal_lm import CausalLM, CausalLMConfig

PREFIX = "_orig_mod."  # what torch.compile adds to every name of a compiled model's state dict
MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")


def nanogpt_config(model_args: Mapping[str, Any]) -> CausalLMConfig:
    """A :class:`~qkv.CausalLMConfig` from a checkpoint's ``model_args`` (nanoGPT's ``GPTConfig`` fields)."""
    missing = [name for name in MODEL_ARGS if name not in model_args]
    if missing:
        raise ValueError(f"nanoGPT model_args lacks {missing}")
    d_model = int(model_args["n_embd"])
    return CausalLMConfig(
        vocab_size=int(model_args["vocab_size"]),
        d_model=d_model,
        num_heads=int(model_args["n_head"]),
        num_layers=int(model_args["n_layer"]),
        d_ff=4 * d_model,
        context=int(model_args["block_size"]),
        dropout=float(model_args["dropout"]),
        attention_dropout=float(model_args["dropout"]),
        activation="gelu",  # nn.GELU(): the exact one
        norm_first=True,
        layer_norm_eps=1e-5,
        positional="learned",
        scale_embedding=False,
        tie_output=True,
        bias=bool(model_args["bias"]),
    )


def nanogpt_key_map(config: CausalLMConfig) -> dict[str, tuple[str, ...]]:
    """nanoGPT parameter name -> the :class:`~qkv.CausalLM` parameter name(s) it fills (three for
    ``c_attn``, split along its output dimension), listed in full; biases only with ``config.bias``."""
    names: dict[str, tuple[str, ...]] = {
        "transformer.wte.weight": ("token_embedding.weight",),
        "transformer.wpe.weight": ("positional.embedding.weight",),
        "transformer.ln_f.weight": ("decoder.norm.weight",),
    }
    params = ["weight", "bias"] if config.bias else ["weight"]
    if config.bias:
        names["transformer.ln_f.bias"] = ("decoder.norm.bias",)
    for i in range(config.num_layers):
        theirs, ours = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for param in params:
            names[f"{theirs}attn.c_attn.{param}"] = tuple(f"{ours}self_attn.{p}_proj.{param}" for p in "qkv")
            for their_name, our_name in (
                ("attn.c_proj", "self_attn.out_proj"),
                ("mlp.c_fc", "feed_forward.linear1"),
                ("mlp.c_proj", "feed_forward.linear2"),
                ("ln_1", "norm1"),
                ("ln_2", "norm2"),
            ):
                names[f"{theirs}{their_name}.{param}"] = (f"{ours}{our_name}.{param}",)
    return names


def build_nanogpt(
    model_args: Mapping[str, Any], state: Mapping[str, Tensor], *, source: str = "checkpoint"
) -> CausalLM:
    """A :class:`~qkv.CausalLM` (eval mode, CPU) holding nanoGPT's ``state`` (its ``GPT.state_dict()``).

    Raises:
        ValueError: keys missing or unexpected, a shape that disagrees with ``model_args``, or an
            untied ``lm_head``; one line naming them.
    """
    try:
        config = nanogpt_config(model_args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None
    state = {k[len(PREFIX) :] if k.startswith(PREFIX) else k: v for k, v in state.items()}
    head = state.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, state.get("transformer.wte.weight", head)):
        raise ValueError(f"{source}: lm_head.weight differs from transformer.wte.weight (qkv ties them)")
    key_map = nanogpt_key_map(config)
    missing, unexpected = sorted(set(key_map) - set(state)), sorted(set(state) - set(key_map))
    if missing or unexpected:
        raise ValueError(f"{source}: not nanoGPT's layout (missing {missing[:4]}, unexpected {unexpected[:4]})")
    model = CausalLM(config)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, targets in key_map.items():
            parts = [params[t] for t in targets]
            want = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if tuple(state[name].shape) != want:
                raise ValueError(f"{source}: {name} has shape {tuple(state[name].shape)}, model_args give {want}")
            for param, piece in zip(parts, state[name].split([p.shape[0] for p in parts]), strict=True):
                param.copy_(piece)
            filled.update(targets)
        for name, param in params.items():  # nanoGPT's bias=False LayerNorms: no bias, i.e. a zero one
            if name not in filled:
                if not (name.endswith(".bias") and ("norm" in name)):
                    raise RuntimeError(f"nanogpt_key_map leaves {name} unfilled")
                param.zero_()
    return model.eval()


def load_nanogpt(path: str | Path) -> tuple[CausalLM, dict[str, Any]]:
    """Load nanoGPT's ``ckpt.pt`` (or the folder holding it) into qkv's :class:`~qkv.CausalLM`.

    Returns:
        ``(model in eval mode on the CPU, info)``: ``info`` holds the checkpoint's ``model_args``,
        ``iter_num``, ``best_val_loss`` and ``parameters`` (its tensors' elements, the tied head once).

    Raises:
        FileNotFoundError: no such file. ValueError: not a checkpoint ``torch.load(weights_only=True)``
            accepts, or not nanoGPT's layout; one line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: nanoGPT checkpoint not found")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler's refusal, a damaged zip: one line, no traceback
        first = (str(err).strip() or type(err).__name__).splitlines()[0][:200]
        raise ValueError(f"{path}: not a checkpoint torch.load(weights_only=True) accepts ({first})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise ValueError(f"{path}: not a nanoGPT checkpoint (no 'model' state dict)")
    model_args = checkpoint.get("model_args")
    if not isinstance(model_args, dict):
        raise ValueError(f"{path}: not a nanoGPT checkpoint (no 'model_args')")
    model = build_nanogpt(model_args, checkpoint["model"], source=str(path))
    info = {
        "model_args": dict(model_args),
        "iter_num": checkpoint.get("iter_num"),
        "best_val_loss": float(checkpoint["best_val_loss"]) if "best_val_loss" in checkpoint else None,
        "parameters": sum(  # nanoGPT's own count: the tied head once, no LayerNorm biases it lacks
            v.numel() for k, v in checkpoint["model"].items() if not k.endswith("lm_head.weight")
        ),
    }
    return model, info


__all__ = ["build_nanogpt", "load_nanogpt", "nanogpt_config", "nanogpt_key_map"]
