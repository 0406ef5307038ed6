"""``qkv export RUN --to hf OUT``: a run as a Hugging Face ``transformers`` folder.

A translation run becomes a ``MarianMTModel`` folder, a language-model run a ``GPT2LMHeadModel``
folder (:mod:`qkv.export.hf_gpt2`) or, when it has their shape, a Llama, Mistral or Qwen2 one
(:mod:`qkv.export.hf_llama`), each with ``config.json``, ``model.safetensors``,
``generation_config.json`` and a tokenizer ``AutoTokenizer`` loads (:mod:`qkv.export.hf_tokenizer`).

Only an exact counterpart is written. A configuration Marian (or GPT-2) cannot express is refused
with a one-line ``ValueError`` naming the field, and every folder is reloaded and its logits
compared with qkv's on a probe batch before it is put in place.

Marian vs qkv: both scale the token embedding by sqrt(d_model), add sinusoids of the same
frequencies, run post-LN layers (no final LayerNorm) and use ``nn.LayerNorm`` (eps 1e-5). One
thing differs in layout: qkv interleaves the sinusoids (sin in even dimensions, cos in odd ones),
Marian puts all sines first and the cosines after. The model is exported in Marian's basis of the
residual stream: a fixed permutation of the d_model dimensions applied to every weight that reads
or writes the stream (embeddings, LayerNorms, the projections' input or output side). LayerNorm,
attention and the tied output projection are unchanged by a permutation of that basis, so the
exported model computes the same function, not an approximation. The tensor map is
:func:`qkv.pretrained.marian.marian_key_map`, the one qkv reads such folders back with
(``qkv attend FOLDER``, :func:`qkv.load_pretrained`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.data.tokenizer import Tokenizer
from qkv.export.hf_common import HF_ACTIVATIONS, check_same_logits, probe_ids
from qkv.export.hf_llama import export_causal_lm
from qkv.export.output import building_export
from qkv.export.output import check_output_folder as check_export_folder
from qkv.models.causal_lm import CausalLM
from qkv.models.options import changed_from_default
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.positional import sinusoidal_table
from qkv.pretrained.marian import marian_key_map, residual_permutation, to_marian

MARIAN_LAYER_NORM_EPS = 1e-5  # Marian's nn.LayerNorm has no eps option


def marian_refusal(config: TransformerConfig) -> str | None:
    """Why ``config`` has no exact ``MarianMTModel`` counterpart, or None when it has one."""
    if config.norm_first:
        return "norm_first=True (pre-LN): Marian's layers are post-LN only"
    if config.positional != "sinusoidal":
        return f"positional={config.positional!r}: Marian has only sinusoidal positions"
    if config.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        return f"layer_norm_eps={config.layer_norm_eps}: Marian's LayerNorm eps is fixed at 1e-5"
    if config.activation not in HF_ACTIVATIONS:
        return f"activation={config.activation!r}: no transformers activation of that name"
    changed = changed_from_default(config, config.OPTIONAL_FIELDS)
    if changed:
        return f"{changed[0]}: Marian has no counterpart of this option of qkv 2.0"
    return None


def marian_config(config: TransformerConfig, tokenizer: Tokenizer) -> Any:
    """The ``MarianConfig`` of a qkv translation model (checked by :func:`marian_refusal` first)."""
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=config.src_vocab_size,
        decoder_vocab_size=config.tgt_vocab_size,
        share_encoder_decoder_embeddings=config.share_embeddings,
        tie_word_embeddings=config.tie_output,
        d_model=config.d_model,
        encoder_layers=config.num_encoder_layers,
        decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=HF_ACTIVATIONS[config.activation],
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.dropout,  # qkv's FeedForward drops after the activation at the residual rate
        max_position_embeddings=config.max_len,
        scale_embedding=True,
        pad_token_id=config.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        decoder_start_token_id=tokenizer.bos_id,  # qkv's decoder starts from BOS
        forced_eos_token_id=None,
        is_encoder_decoder=True,
    )


def marian_state(model: Transformer) -> dict[str, Tensor]:
    """``MarianMTModel`` tensors by name for ``model``, in Marian's residual basis
    (:func:`~qkv.pretrained.marian.marian_key_map`, the map qkv reads folders back with), with the
    tied copies Marian's state dict also lists and a zero logits bias; the sinusoid tables are
    Marian's own and not listed. A ``bias=False`` model's biases are zeros (Marian always has
    biases: zeros compute the same)."""
    config = model.config
    perm = residual_permutation(config.d_model)
    ours = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
    out: dict[str, Tensor] = {}
    for hf, entry in marian_key_map(config).items():
        tensor = ours.get(entry.qkv)
        if tensor is None:  # a bias of a bias=False model: as long as its weight's output side
            tensor = torch.zeros(ours[entry.qkv.removesuffix(".bias") + ".weight"].size(0))
        out[hf] = to_marian(tensor, entry.side, perm)
    out["model.encoder.embed_tokens.weight"] = to_marian(ours["src_embed.embedding.weight"], "in", perm)
    out["model.decoder.embed_tokens.weight"] = to_marian(ours["tgt_embed.embedding.weight"], "in", perm)
    out["lm_head.weight"] = to_marian(ours["output_proj.weight"], "in", perm)
    out["final_logits_bias"] = torch.zeros(1, config.tgt_vocab_size)
    return {name: t.contiguous() for name, t in out.items()}


def build_marian(model: Transformer, tokenizer: Tokenizer) -> Any:
    """A ``MarianMTModel`` (eval mode) computing what ``model`` computes.

    Raises:
        ValueError: the configuration has no exact Marian counterpart (one line naming the field).
    """
    from transformers import MarianMTModel

    reason = marian_refusal(model.config)
    if reason is not None:
        raise ValueError(f"cannot export to Marian: {reason}")
    hf_model = MarianMTModel(marian_config(model.config, tokenizer))
    state = marian_state(model)
    params = hf_model.state_dict()
    missing = sorted(k for k in params if k not in state and ".embed_positions." not in k)
    extra = sorted(k for k in state if k not in params)
    if missing or extra:  # the name map is the contract with this transformers version
        raise RuntimeError(f"Marian name map disagrees with transformers: missing {missing[:4]}, extra {extra[:4]}")
    perm = residual_permutation(model.config.d_model)
    theirs = hf_model.model.encoder.embed_positions.weight.detach()
    ours = sinusoidal_table(model.config.max_len, model.config.d_model)[:, perm]
    if not torch.allclose(theirs, ours, atol=1e-6):  # guard the layout the permutation relies on
        raise RuntimeError("Marian's sinusoid table differs from qkv's permuted one; not exported")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return hf_model.eval()


def generation_settings(config: dict, tokenizer: Tokenizer, max_len: int) -> dict:
    """``generation_config.json`` fields: the run's beam size and length penalty (its recipe's
    :func:`~qkv.inference.decode.decode_settings`), BOS as the decoder's start, early stopping.

    Hugging Face divides a finished hypothesis's log-probability by ``len ** length_penalty``
    (len counts EOS, not the decoder start): qkv's ``penalty="power"``, not its default GNMT
    ``((5 + len) / 6) ** alpha``. ``generate`` with these settings picks the translations of
    ``beam_search(..., penalty="power")`` (tests/test_export_hf.py); with qkv's default form the
    same alpha can rank beams differently. ``max_length`` is the positional table's: qkv's own
    limit is ``min(source + 50, max_len - 1)`` new tokens, which ``max_new_tokens`` sets per call."""
    from qkv.inference.decode import decode_settings

    decode = decode_settings(config)
    return dict(
        num_beams=decode["beam_size"],
        length_penalty=decode["alpha"],
        early_stopping=True,  # qkv finishes a sentence once it has beam_size finished hypotheses
        max_length=max_len,  # the positional table: qkv's limit is also min(source + 50, max_len - 1)
        decoder_start_token_id=tokenizer.bos_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


def _check_marian_folder(model: Transformer, folder: Path) -> None:
    """Reload ``folder`` with ``transformers`` and compare teacher-forced logits with qkv's."""
    from transformers import MarianMTModel

    reloaded = MarianMTModel.from_pretrained(str(folder)).eval()
    first = 4  # above the special ids
    length = min(7, model.config.max_len)
    src = probe_ids(model.config.src_vocab_size, first, length=length)
    tgt = probe_ids(model.config.tgt_vocab_size, first, length=length, seed=1)
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = reloaded(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt).logits
    check_same_logits("Marian model", ours, theirs)


def export_translation(model: Transformer, tokenizer: Tokenizer, config: dict, out: Path) -> None:
    """Write ``model`` as a ``MarianMTModel`` folder at ``out`` (assembled aside, checked, then moved in)."""
    from transformers import GenerationConfig

    from qkv.export.hf_tokenizer import save_bpe_tokenizer

    hf_model = build_marian(model, tokenizer)
    hf_model.generation_config = GenerationConfig(**generation_settings(config, tokenizer, model.config.max_len))
    with building_export(out, kind="hf", tag="export") as tmp:
        hf_model.save_pretrained(str(tmp), safe_serialization=True)
        save_bpe_tokenizer(tokenizer, tmp, max_len=model.config.max_len, append_eos=True)
        _check_marian_folder(model, tmp)


def check_output_folder(out: str | Path, *, overwrite: bool, run_dir: str | Path | None = None) -> Path:
    """``out`` must not exist, be empty, or (with ``overwrite``) hold an earlier Hugging Face export
    and nothing else (:func:`qkv.export.output.check_output_folder`). Returns the path to build at."""
    return check_export_folder(out, overwrite=overwrite, kind="hf", run_dir=run_dir)


def export_hf(run_dir: str | Path, out: str | Path, *, weights: str = "model", overwrite: bool = False) -> Path:
    """Export a qkv run as a Hugging Face folder (Marian for translation; GPT-2, Llama, Mistral or
    Qwen2 for a language model, :func:`~qkv.export.hf_llama.export_causal_lm`).

    Args:
        run_dir: the run folder.
        out: the folder to write (must not exist or be empty, unless ``overwrite`` replaces an export).
        weights: which of the run's weights (see :func:`qkv.runs.folder.load_run`).
        overwrite: replace an earlier Hugging Face export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: the model has no exact counterpart (one line naming the field), or ``out`` is taken.
        PermissionError: ``out`` cannot be written (checked before any work).
        FileNotFoundError: the run is missing a file.
    """
    from qkv.runs.folder import load_run

    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, config = load_run(run_dir, weights)
    if isinstance(model, CausalLM):
        export_causal_lm(model, tokenizer, target)
    else:
        assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # a translation run's
        export_translation(model, tokenizer, config, target)
    return out
