"""Llama, Mistral and Qwen2 checkpoints in qkv's own :class:`~qkv.CausalLM`.

The three families share one layout: pre-norm blocks of RMSNorm, self-attention with rotary
positions (HF's "rotate_half" pairing) and grouped-query key/value heads, RMSNorm again and a gated
SiLU feed-forward network (SwiGLU), a final RMSNorm and an output projection (untied unless
``tie_word_embeddings``). Their options become :class:`~qkv.CausalLMConfig` fields in
:mod:`qkv.pretrained.llama_config`, which refuses any without an exact counterpart; the tensors are
copied through the explicit map :func:`llama_key_map`, every shape checked; the tokenizer is the
folder's ``tokenizer.json`` (:class:`PretrainedTokenizer`). No Hugging Face modelling code runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as _RustTokenizer
from torch import Tensor

from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.pretrained.bert import _short_list, check_key_sets
from qkv.pretrained.gpt2 import GPT2Tokenizer, PretrainedCausalLM
from qkv.pretrained.llama_config import LLAMA_MODEL_TYPES, _first_line, llama_config, read_llama_config
from qkv.pretrained.tokenizer import QkvTextTokenizer, qkv_text_tokenizer, read_backend
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import read_json
from qkv.runtime.safe_load import check_fits_weights, check_layer_counts

logger = logging.getLogger(__name__)


def llama_key_map(config: CausalLMConfig) -> dict[str, str]:
    """Hugging Face parameter name (``LlamaForCausalLM``'s, also Mistral's and Qwen2's) -> qkv
    :class:`~qkv.CausalLM` parameter name, listed in full; ``lm_head.weight`` only when untied.

    Args:
        config: the architecture (from :func:`llama_config`).

    Returns:
        The map.
    """
    names = {"model.embed_tokens.weight": "token_embedding.weight", "model.norm.weight": "decoder.norm.weight"}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        linears = {f"self_attn.{p}_proj": f"self_attn.{p}_proj" for p in "qkv"}
        linears |= {
            "self_attn.o_proj": "self_attn.out_proj",
            "mlp.gate_proj": "feed_forward.gate",
            "mlp.up_proj": "feed_forward.linear1",
            "mlp.down_proj": "feed_forward.linear2",
        }
        for theirs, mine in linears.items():
            names[f"{hf}{theirs}.weight"] = f"{ours}{mine}.weight"
            if config.qkv_bias if theirs[-6:] in ("q_proj", "k_proj", "v_proj") else config.bias:
                names[f"{hf}{theirs}.bias"] = f"{ours}{mine}.bias"
        names[hf + "input_layernorm.weight"] = ours + "norm1.weight"  # before attention
        names[hf + "post_attention_layernorm.weight"] = ours + "norm2.weight"  # before the feed-forward
    if not config.tie_output:
        names["lm_head.weight"] = "output_proj.weight"
    return names


def normalize_llama_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Bring a checkpoint's names to ``LlamaForCausalLM``'s: a bare ``LlamaModel``'s names get the
    ``model.`` prefix, and the rotary ``inv_freq`` buffers older checkpoints saved (derived from the
    config, not weights) are dropped."""
    bare = not any(key.startswith("model.") for key in state)
    out = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        out[f"model.{key}" if bare and key != "lm_head.weight" else key] = value
    return out


def build_llama(
    config: CausalLMConfig, state: Mapping[str, Tensor], *, source: str = "checkpoint"
) -> PretrainedCausalLM:
    """Build a :class:`~qkv.CausalLM` and copy ``state`` into it through :func:`llama_key_map`.

    Args:
        config: the architecture (from :func:`llama_config`).
        state: the checkpoint's tensors by name (with a tied output an ``lm_head.weight`` is
            shape-checked and then ignored, as transformers does).
        source: how to name the checkpoint in error messages.

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: keys are missing or unexpected, or a shape or dtype disagrees with the config;
            one line naming them.
    """
    state = normalize_llama_keys(state)
    check_layer_counts(
        state,
        {"num_hidden_layers": ("model.layers.", config.num_layers)},
        config_path="config.json",
        weights_path=source,
        only_more=True,
    )
    key_map = llama_key_map(config)
    given = dict(state)
    if config.tie_output:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    check_key_sets(state, key_map, source, "Llama-family")
    try:
        with torch.device("meta"):  # shapes first, no memory
            probe = CausalLM(config)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"{source}: config.json describes no model qkv can build ({_first_line(err)})") from None
    params = dict(probe.named_parameters())  # a tied output_proj.weight is listed once, as token_embedding
    if set(key_map.values()) != set(params):  # the map itself is the contract; guard it
        raise RuntimeError(f"llama_key_map disagrees with CausalLM: {sorted(set(key_map.values()) ^ set(params))}")
    expected = {hf: tuple(params[ours].shape) for hf, ours in key_map.items()}
    if config.tie_output and "lm_head.weight" in given:
        expected["lm_head.weight"] = tuple(params["token_embedding.weight"].shape)
    wrong = [
        f"{hf} {tuple(given[hf].shape)} vs expected {shape}"
        for hf, shape in expected.items()
        if tuple(given[hf].shape) != shape
    ]
    if wrong:
        raise ValueError(f"{source}: tensor shapes disagree with config.json: {_short_list(wrong, 4)}")
    check_fits_weights(
        probe, sum(t.numel() * 4 for t in state.values()), config_path="config.json", weights_path=source
    )
    model = PretrainedCausalLM(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf, ours in key_map.items():
            if not state[hf].dtype.is_floating_point:
                raise ValueError(f"{source}: {hf} has dtype {state[hf].dtype}, expected a floating-point tensor")
            params[ours].copy_(state[hf].to(params[ours].dtype))
    return model.eval()


class PretrainedTokenizer(GPT2Tokenizer):
    """The ``tokenizer.json`` of a Llama, Mistral or Qwen2 folder, with the interface of
    :class:`~qkv.pretrained.gpt2.GPT2Tokenizer`; :meth:`encode` puts the tokens the folder's
    tokenizer puts in front of a text (the BOS of Llama and Mistral) before it.

    Args:
        backend: the ``tokenizers`` tokenizer.
        prefix: the ids :meth:`encode` puts first.
        eos_id: the end-of-sequence id, if any.
    """

    def __init__(self, backend: _RustTokenizer, *, prefix: Sequence[int] = (), eos_id: int | None = None) -> None:
        super().__init__(backend)
        self.prefix = [int(i) for i in prefix]
        self.eos_id = eos_id

    @classmethod
    def from_folder(cls, folder: str | Path, config: Mapping[str, Any] | None = None) -> PretrainedTokenizer:
        """Read ``tokenizer.json`` (and ``tokenizer_config.json`` when there is one).

        What goes before a text: ``tokenizer_config.json``'s ``add_bos_token`` when it says (as
        transformers' Llama tokenizer before version 5 read it), else what ``tokenizer.json``'s
        post-processor adds in front (what transformers 5 does). Appended tokens (an EOS after the
        text) are left out: a prompt is continued, not ended.

        Args:
            folder: the checkpoint folder.
            config: the folder's ``config.json`` (its ``bos_token_id`` / ``eos_token_id`` when the
                tokenizer files name no such token).

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: no ``tokenizer.json``. ValueError: a file cannot be read.
        """
        folder, config = Path(folder), config or {}
        path, settings_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json")
        backend = read_backend(path)
        settings = read_json(settings_path) if settings_path.is_file() else {}
        settings = settings if isinstance(settings, dict) else {}
        bos = _special_id(backend, settings.get("bos_token"), config.get("bos_token_id"))
        eos = _special_id(backend, settings.get("eos_token"), config.get("eos_token_id"))
        add_bos = settings.get("add_bos_token")
        if add_bos is True:
            if bos is None:
                raise ValueError(f"{settings_path}: add_bos_token is true but no BOS token is named")
            prefix = [bos]
        elif add_bos is False:
            prefix = []
        else:
            prefix = _template_prefix(backend)
        return cls(backend, prefix=prefix, eos_id=eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, after :attr:`prefix`."""
        return self.prefix + self.backend.encode(text, add_special_tokens=False).ids


def _special_id(backend: _RustTokenizer, token: object, fallback: object) -> int | None:
    """The id of a special token named in ``tokenizer_config.json`` (a string or an AddedToken
    object), else ``config.json``'s id (the first of a list)."""
    content = token.get("content") if isinstance(token, dict) else token
    if isinstance(content, str) and backend.token_to_id(content) is not None:
        return backend.token_to_id(content)
    if isinstance(fallback, list):
        fallback = fallback[0] if fallback else None
    return fallback if isinstance(fallback, int) and not isinstance(fallback, bool) else None


def _template_prefix(backend: _RustTokenizer) -> list[int]:
    """The ids ``backend``'s post-processor puts before a text."""
    probe = "a probe"
    plain = backend.encode(probe, add_special_tokens=False).ids
    full = backend.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    logger.warning("tokenizer.json's post-processor changes the text's tokens; adding nothing before a prompt")
    return []


def load_llama(
    folder: str | Path, device: str | torch.device | None = None
) -> tuple[PretrainedCausalLM, PretrainedTokenizer | QkvTextTokenizer]:
    """Load a transformers Llama, Mistral or Qwen2 folder into qkv's :class:`~qkv.CausalLM`.

    Args:
        folder: holds ``config.json``, ``model.safetensors`` (or sharded, with
            ``model.safetensors.index.json``) or ``pytorch_model.bin``, and ``tokenizer.json``.
        device: where to put the model; defaults to CUDA when available, else CPU.

    Returns:
        ``(model in eval mode, tokenizer)``; the tokenizer is also ``model.tokenizer`` (for a folder
        ``qkv export --to hf`` wrote, the run's own tokenizer class, as :func:`~qkv.pretrained.gpt2.load_gpt2`).

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: a bad device, a config without an exact counterpart, corrupt weights,
            missing/unexpected keys or shapes that disagree with the config, a tokenizer larger than
            the vocabulary (one line naming them).
    """
    from qkv.pretrained import read_weights  # here: the package imports this module

    device = pick_device(device)  # before any loading: a bad device fails at once
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: checkpoint folder not found")
    config, data = read_llama_config(folder)
    state, weights_file = read_weights(folder)
    model = build_llama(config, state, source=str(weights_file))
    own = qkv_text_tokenizer(folder)  # a folder qkv wrote: its run's tokenizer class
    tokenizer = PretrainedTokenizer.from_folder(folder, data) if own is None else own
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but config vocab_size is {config.vocab_size}"
        )
    model.tokenizer, model.name = tokenizer, folder.name
    logger.debug(
        "loaded %s (%s, %d layers, %d/%d heads, d=%d) from %s",
        folder.name,
        data.get("model_type"),
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.d_model,
        weights_file,
    )
    return model.to(device), tokenizer


__all__ = [
    "LLAMA_MODEL_TYPES",
    "PretrainedTokenizer",
    "build_llama",
    "llama_config",
    "llama_key_map",
    "load_llama",
    "normalize_llama_keys",
    "read_llama_config",
]
