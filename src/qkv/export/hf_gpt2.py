"""A qkv language model as a Hugging Face ``GPT2LMHeadModel`` folder, when it is GPT-2's architecture.

The tensor names are the inverse of the map qkv loads GPT-2 checkpoints with
(:func:`qkv.pretrained.gpt2.gpt2_key_map`): ``q_proj``/``k_proj``/``v_proj`` are packed side by side
into ``attn.c_attn`` and every ``Conv1D`` weight is stored ``(in, out)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.export.hf_common import HF_ACTIVATIONS, check_same_logits, probe_ids
from qkv.export.output import building_export
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.options import changed_from_default
from qkv.pretrained.gpt2 import gpt2_key_map


def gpt2_refusal(config: CausalLMConfig) -> str | None:
    """Why ``config`` has no exact ``GPT2LMHeadModel`` counterpart, or None when it has one."""
    if not config.norm_first:
        return "norm_first=False (post-LN): GPT-2's blocks are pre-LN"
    if config.positional != "learned":
        return f"positional={config.positional!r}: GPT-2 has learned positions only"
    if config.scale_embedding:
        return "scale_embedding=True: GPT-2 does not scale its token embedding"
    if config.activation not in HF_ACTIVATIONS:
        return f"activation={config.activation!r}: no transformers activation of that name"
    changed = changed_from_default(config, config.OPTIONAL_FIELDS)
    if changed:
        return f"{changed[0]}: GPT-2 has no counterpart of this option of qkv 2.0"
    return None


def gpt2_config(config: CausalLMConfig, tokenizer: Tokenizer | CharTokenizer) -> Any:
    """The ``GPT2Config`` of a qkv language model (checked by :func:`gpt2_refusal` first)."""
    from transformers import GPT2Config

    # a qkv language model reads a continuous stream: BPE runs have special ids, character runs none
    special = tokenizer.eos_id if isinstance(tokenizer, Tokenizer) else None
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.context,
        n_embd=config.d_model,
        n_layer=config.num_layers,
        n_head=config.num_heads,
        n_inner=config.d_ff,
        activation_function=HF_ACTIVATIONS[config.activation],
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        tie_word_embeddings=config.tie_output,
        bos_token_id=special,
        eos_token_id=special,
    )


def gpt2_state(model: CausalLM) -> dict[str, Tensor]:
    """``GPT2LMHeadModel`` tensors by name for ``model`` (zero biases for a model without biases:
    GPT-2 always has them, and zeros compute the same)."""
    ours = {name: t.detach().float().cpu() for name, t in model.named_parameters()}
    out: dict[str, Tensor] = {}
    for hf, entry in gpt2_key_map(model.config).items():
        parts = []
        for target in entry.targets:
            if target in ours:
                parts.append(ours[target])
            else:  # a bias of a bias=False model: as long as its weight's output side
                parts.append(torch.zeros(ours[target.removesuffix(".bias") + ".weight"].size(0)))
        tensor = torch.cat(parts, dim=0)
        if entry.conv1d:
            tensor = tensor.t()  # nn.Linear's (out, in) -> Conv1D's (in, out)
        name = hf if hf == "lm_head.weight" else f"transformer.{hf}"
        out[name] = tensor.contiguous()
    return out


def build_gpt2_model(model: CausalLM, tokenizer: Tokenizer | CharTokenizer) -> Any:
    """A ``GPT2LMHeadModel`` (eval mode) computing what ``model`` computes.

    Raises:
        ValueError: the configuration is not GPT-2's architecture (one line naming the field).
    """
    from transformers import GPT2LMHeadModel

    reason = gpt2_refusal(model.config)
    if reason is not None:
        raise ValueError(f"cannot export to GPT-2: {reason}")
    hf_model = GPT2LMHeadModel(gpt2_config(model.config, tokenizer))
    state = gpt2_state(model)
    params = hf_model.state_dict()
    expected = {k for k in params if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if model.config.tie_output:
        expected.discard("lm_head.weight")
    if expected != set(state):  # the name map is the contract with this transformers version
        raise RuntimeError(f"GPT-2 name map disagrees with transformers: {sorted(expected ^ set(state))[:4]}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return hf_model.eval()


def export_language_model(model: CausalLM, tokenizer: Tokenizer | CharTokenizer, out: Path) -> None:
    """Write ``model`` as a ``GPT2LMHeadModel`` folder with its tokenizer at ``out`` (assembled
    aside, reloaded and compared with qkv's logits, then moved in)."""
    from transformers import GPT2LMHeadModel

    from qkv.export.hf_tokenizer import save_bpe_tokenizer, save_char_tokenizer

    hf_model = build_gpt2_model(model, tokenizer)
    with building_export(out, kind="hf", tag="export") as tmp:
        hf_model.save_pretrained(str(tmp), safe_serialization=True)
        if isinstance(tokenizer, CharTokenizer):
            save_char_tokenizer(tokenizer, tmp, max_len=model.config.context)
        else:
            save_bpe_tokenizer(tokenizer, tmp, max_len=model.config.context, append_eos=False)
        reloaded = GPT2LMHeadModel.from_pretrained(str(tmp)).eval()
        ids = probe_ids(model.config.vocab_size, 0, length=min(7, model.config.context))
        with torch.no_grad():
            ours = model(ids).logits
            assert ours is not None  # projected by default
            check_same_logits("GPT-2 model", ours, reloaded(input_ids=ids).logits)
