"""A qkv language model as a Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM`` or
``Qwen2ForCausalLM`` folder, when it has the shape of one of them.

The inverse of :mod:`qkv.pretrained.llama`: the tensors go out through the same explicit name map
(:func:`qkv.pretrained.llama.llama_key_map`, read the other way), and the ``config.json`` written is
one that :func:`qkv.pretrained.llama_config.llama_config` reads back into the same
:class:`~qkv.CausalLMConfig`. The shape these families share: pre-norm RMSNorm blocks, rotary
positions over whole heads (HF's "rotate_half" pairing), grouped-query heads, a gated feed-forward
(SwiGLU; GeGLU as ``hidden_act="gelu"``), no embedding scaling, a final RMSNorm. The family is
chosen by the options that tell them apart (:func:`llama_family`):

- Qwen2: biases on the q/k/v projections only (``qkv_bias=True, bias=False``), or a sliding window
  on some layers only (Qwen2 lists them in ``layer_types``);
- Mistral: a sliding window on every layer, no biases;
- Llama: everything else, rotary scaling (``linear``, ``llama3``) and biases everywhere
  (``attention_bias`` and ``mlp_bias``) included.

A configuration none of them expresses exactly is refused in one line naming the field
(:func:`llama_refusal`). Dropout is a training setting: the exported model computes what the run's
model computes in eval mode, and the folder reads back with ``dropout=0``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.export.hf_common import check_same_logits, probe_ids
from qkv.export.hf_gpt2 import export_language_model, gpt2_refusal
from qkv.export.output import building_export
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.pretrained.llama import llama_key_map

# qkv's gated activation -> the hidden_act these families compute as act(gate(x)) * up(x)
HF_GATED = {"swiglu": "silu", "geglu": "gelu"}  # ACT2FN's "gelu" is the exact (erf) GELU, as qkv's geglu
FAMILIES = ("llama", "mistral", "qwen2")
LOGITS_PROBE = 16  # tokens of the logits check (more when a window is longer, so that the window matters)


def _qkv_bias(config: CausalLMConfig) -> bool:
    """Whether the q/k/v projections have biases (``qkv_bias``, or ``bias`` where it is None)."""
    return config.bias if config.qkv_bias is None else config.qkv_bias


def _windowed_layers(config: CausalLMConfig) -> list[int]:
    """The layers whose self-attention has the sliding window."""
    return [i for i in range(config.num_layers) if config.window(i) is not None]


def llama_family(config: CausalLMConfig) -> str:
    """The family whose folder holds ``config`` (one of :data:`FAMILIES`; :func:`llama_refusal` says
    whether it does so exactly).

    Args:
        config: the language model's config.

    Returns:
        ``"qwen2"`` for q/k/v biases without the others or a window on some layers only,
        ``"mistral"`` for a window on every layer, else ``"llama"``.
    """
    windowed = _windowed_layers(config)
    if (_qkv_bias(config) and not config.bias) or 0 < len(windowed) < config.num_layers:
        return "qwen2"
    if windowed:
        return "mistral"
    return "llama"


def llama_refusal(config: CausalLMConfig) -> str | None:
    """Why ``config`` has no exact Llama, Mistral or Qwen2 counterpart, or None when it has one.

    Args:
        config: the language model's config.

    Returns:
        A clause naming the first field that has no counterpart, or None.
    """
    if config.norm != "rms":
        return f"norm={config.norm!r}: Llama, Mistral and Qwen2 use RMSNorm (norm='rms')"
    if not config.norm_first:
        return "norm_first=False (post-LN): Llama, Mistral and Qwen2 blocks are pre-norm"
    if config.positional != "rotary":
        return f"positional={config.positional!r}: Llama, Mistral and Qwen2 have rotary positions only"
    if config.rotary_fraction != 1.0:
        return f"rotary_fraction={config.rotary_fraction}: Llama, Mistral and Qwen2 rotate whole heads"
    if config.activation not in HF_GATED:
        return f"activation={config.activation!r}: Llama, Mistral and Qwen2 have a gated feed-forward (swiglu, geglu)"
    if config.scale_embedding:
        return "scale_embedding=True: Llama, Mistral and Qwen2 do not scale the token embedding"
    if config.qk_norm:
        return "qk_norm=True: Llama, Mistral and Qwen2 have no norm over the queries and keys"
    if config.logit_softcap is not None:
        return f"logit_softcap={config.logit_softcap}: Llama, Mistral and Qwen2 do not soft-cap the logits"
    qkv_bias, windowed = _qkv_bias(config), _windowed_layers(config)
    if config.bias and not qkv_bias:
        return "qkv_bias=False with bias=True: Llama's attention_bias covers q/k/v and o_proj together"
    if windowed and config.bias:
        return "bias=True with a sliding window: Mistral has no biases, Qwen2 none on o_proj and the feed-forward"
    if 0 < len(windowed) < config.num_layers and not qkv_bias:
        return (
            f"sliding_window_layers={config.sliding_window_layers}: a window on some layers exists in Qwen2 only, "
            "whose q/k/v projections have biases (qkv_bias=True)"
        )
    return None


def _rope_parameters(config: CausalLMConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of the rotary settings (what the reader's
    ``_rope_options`` maps back)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rotary_scaling == "linear":
        params.update(rope_type="linear", factor=float(config.rotary_scaling_factor))
    elif config.rotary_scaling == "llama3":
        params.update(
            rope_type="llama3",
            factor=float(config.rotary_scaling_factor),
            low_freq_factor=float(config.rotary_low_freq_factor),
            high_freq_factor=float(config.rotary_high_freq_factor),
            original_max_position_embeddings=config.rotary_original_context,
        )
    return params


def llama_hf_config(config: CausalLMConfig, tokenizer: Tokenizer | CharTokenizer) -> Any:
    """The ``LlamaConfig``, ``MistralConfig`` or ``Qwen2Config`` of a qkv language model (checked by
    :func:`llama_refusal` first).

    Args:
        config: the language model's config.
        tokenizer: the run's tokenizer (a BPE one's EOS id is named; a character one has none).

    Returns:
        The transformers config.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    special = tokenizer.eos_id if isinstance(tokenizer, Tokenizer) else None  # a stream: no BOS before a text
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads if config.num_kv_heads is None else config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act=HF_GATED[config.activation],
        max_position_embeddings=config.context,
        rms_norm_eps=config.layer_norm_eps,
        tie_word_embeddings=config.tie_output,
        rope_parameters=_rope_parameters(config),
        attention_dropout=config.attention_dropout,
        bos_token_id=special,
        eos_token_id=special,
        pad_token_id=None,
    )
    family = llama_family(config)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=config.sliding_window)
    if family == "qwen2":
        del common["head_dim"]  # Qwen2's heads are hidden_size // num_attention_heads wide
        windowed = _windowed_layers(config)
        layer_types = ["sliding_attention" if i in windowed else "full_attention" for i in range(config.num_layers)]
        return Qwen2Config(
            **common,
            use_sliding_window=bool(windowed),
            sliding_window=config.sliding_window if windowed else None,
            max_window_layers=windowed[0] if windowed else config.num_layers,
            layer_types=layer_types,
        )
    return LlamaConfig(**common, attention_bias=config.bias, mlp_bias=config.bias)


def llama_state(model: CausalLM) -> dict[str, Tensor]:
    """The Hugging Face tensors by name for ``model``: :func:`~qkv.pretrained.llama.llama_key_map`
    read from qkv's names to theirs (``lm_head.weight`` only when the output is untied).

    Args:
        model: the language model.

    Returns:
        float32 CPU tensors by Hugging Face name.
    """
    ours = {name: t.detach().float().cpu() for name, t in model.named_parameters()}
    config = replace(model.config, qkv_bias=_qkv_bias(model.config))  # the map reads qkv_bias as a bool
    return {hf: ours[mine].contiguous() for hf, mine in llama_key_map(config).items()}


def _family_class(family: str) -> Any:
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[family]


def build_llama_model(model: CausalLM, tokenizer: Tokenizer | CharTokenizer) -> Any:
    """A ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM`` (eval mode, float32)
    computing what ``model`` computes.

    Args:
        model: the language model.
        tokenizer: the run's tokenizer.

    Returns:
        The transformers model.

    Raises:
        ValueError: the configuration has no exact counterpart (one line naming the field).
        RuntimeError: the name map disagrees with this transformers version's modules.
    """
    reason = llama_refusal(model.config)
    if reason is not None:
        raise ValueError(f"cannot export to Llama/Mistral/Qwen2: {reason}")
    hf_config = llama_hf_config(model.config, tokenizer)
    hf_model = _family_class(llama_family(model.config))(hf_config)
    state = llama_state(model)
    params = hf_model.state_dict()
    expected = set(params)
    if model.config.tie_output:
        expected.discard("lm_head.weight")  # transformers ties it to the embedding
    if expected != set(state):  # the name map is the contract with this transformers version
        raise RuntimeError(f"Llama name map disagrees with transformers: {sorted(expected ^ set(state))[:4]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} vs transformers' {tuple(params[name].shape)}")
            params[name].copy_(tensor)
    return hf_model.float().eval()


def probe_length(config: CausalLMConfig) -> int:
    """The tokens of the logits check a folder gets before it is put in place.

    Args:
        config: the language model's config.

    Returns:
        :data:`LOGITS_PROBE`, or more than the window when there is one (so that the window masks
        something), at most the context.
    """
    window = config.sliding_window or 0
    return min(config.context, max(LOGITS_PROBE, window + 8))


def export_llama(model: CausalLM, tokenizer: Tokenizer | CharTokenizer, out: Path) -> None:
    """Write ``model`` as a Llama, Mistral or Qwen2 folder with its tokenizer at ``out``: assembled
    aside, reloaded with ``AutoModelForCausalLM`` and its logits compared with qkv's, then moved in.

    Args:
        model: the language model.
        tokenizer: the run's tokenizer (written as ``tokenizer.json``, as the GPT-2 export writes it).
        out: the folder to write (checked by the caller).

    Raises:
        ValueError: no exact counterpart (one line naming the field).
        RuntimeError: the reloaded folder's logits differ from qkv's.
    """
    hf_model = build_llama_model(model, tokenizer)
    was_training = model.training
    model.eval()  # the check compares eval-mode logits; the caller's mode is restored after
    try:
        _write_checked(model, tokenizer, hf_model, out)
    finally:
        model.train(was_training)


def _write_checked(model: CausalLM, tokenizer: Tokenizer | CharTokenizer, hf_model: Any, out: Path) -> None:
    """Save ``hf_model`` and the tokenizer aside, reload the folder and compare its logits with
    ``model``'s, then move it to ``out``."""
    from transformers import AutoModelForCausalLM

    from qkv.export.hf_tokenizer import save_bpe_tokenizer, save_char_tokenizer

    with building_export(out, kind="hf", tag="export") as tmp:
        hf_model.save_pretrained(str(tmp), safe_serialization=True)
        if isinstance(tokenizer, CharTokenizer):
            save_char_tokenizer(tokenizer, tmp, max_len=model.config.context)
        else:
            save_bpe_tokenizer(tokenizer, tmp, max_len=model.config.context, append_eos=False)
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
        ids = probe_ids(model.config.vocab_size, 0, length=probe_length(model.config))
        with torch.no_grad():
            ours = model(ids).logits
            assert ours is not None  # projected by default
            check_same_logits(f"{llama_family(model.config)} model", ours, reloaded(input_ids=ids).logits)


def _llama_like(config: CausalLMConfig) -> bool:
    """Whether ``config`` has a part of the Llama families that GPT-2 lacks: RMSNorm, rotary
    positions, a gated feed-forward, grouped-query heads or a sliding window."""
    return (
        config.norm == "rms"
        or config.positional == "rotary"
        or config.activation in HF_GATED
        or config.num_kv_heads is not None
        or config.sliding_window is not None
    )


def lm_refusal(config: CausalLMConfig) -> str | None:
    """Why ``--to hf`` cannot write ``config`` as any family, or None: the refusal of the family
    closer to it (Llama's when it has a part of theirs that GPT-2 lacks, else GPT-2's).

    Args:
        config: the language model's config.

    Returns:
        ``"cannot export to ...: reason"``, or None when GPT-2 or a Llama family holds it.
    """
    gpt2, llama = gpt2_refusal(config), llama_refusal(config)
    if gpt2 is None or llama is None:
        return None
    if _llama_like(config):
        return f"cannot export to Llama/Mistral/Qwen2: {llama}"
    return f"cannot export to GPT-2: {gpt2}"


def export_causal_lm(model: CausalLM, tokenizer: Tokenizer | CharTokenizer, out: Path) -> str:
    """Write a language model as the Hugging Face folder that holds it exactly: ``GPT2LMHeadModel``
    when it is GPT-2-shaped, else Llama, Mistral or Qwen2.

    Args:
        model: the language model.
        tokenizer: the run's tokenizer.
        out: the folder to write (checked by the caller).

    Returns:
        The family written: ``"gpt2"``, ``"llama"``, ``"mistral"`` or ``"qwen2"``.

    Raises:
        ValueError: neither fits (one line: the closer family's reason, see :func:`lm_refusal`).
    """
    reason = lm_refusal(model.config)
    if reason is not None:
        raise ValueError(reason)
    if gpt2_refusal(model.config) is None:
        export_language_model(model, tokenizer, out)
        return "gpt2"
    export_llama(model, tokenizer, out)
    return llama_family(model.config)


__all__ = [
    "FAMILIES",
    "build_llama_model",
    "export_causal_lm",
    "export_llama",
    "llama_family",
    "llama_hf_config",
    "llama_refusal",
    "llama_state",
    "lm_refusal",
]
