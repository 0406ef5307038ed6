"""``qkv export RUN --to ctranslate2 OUT``: a translation run as a CTranslate2 model folder.

The model is described with CTranslate2's own specification classes (``TransformerSpec`` with an
encoder and a decoder spec) filled with the run's weights, then saved by CTranslate2
(``model.bin``, ``config.json``, the vocabularies). The folder also holds the run's
``tokenizer.json`` and ``qkv_ct2.json`` (special ids, limits, the run's decoding settings), which
:class:`~qkv.inference.ctranslate2.Ct2Translator` (the CTranslate2 engine, re-exported here) reads to
translate text as :func:`qkv.decoding.translate.translate_texts` does.

Why the spec rather than the Marian folder of ``--to hf`` plus CTranslate2's Transformers
converter: the spec takes the positional table as a tensor, so qkv's own table (sines and cosines
interleaved, or a learned table) is written as it is, with no change of basis; pre-LN models have a
spec counterpart (``pre_norm`` with a final LayerNorm) that Marian lacks; and the decoder's start
token is set to qkv's BOS directly, not the converter's Marian conventions.

Every float32 folder is reloaded and its teacher-forced token log-probabilities (``score_batch``)
compared with qkv's before it is put in place; a quantized one (int8, ...) must load and translate.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.data.tokenizer import SPECIALS, Tokenizer
from qkv.export.output import building_export
from qkv.export.output import check_output_folder as check_export_folder
from qkv.inference.ctranslate2 import (  # the engine; re-exported: qkv 1.x defined it here
    EXTRA_LEN,
    MANIFEST,
    MANIFEST_FORMAT,
    Ct2Translator,
    vocabulary,
)
from qkv.inference.decode import DecodeConfig
from qkv.inference.kinds import SEQ2SEQ
from qkv.inference.runs import load_run
from qkv.models.options import changed_from_default
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runtime.fileio import write_json

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16")
CHECK_TOL = 1e-4  # float32 log-probabilities of the saved folder vs qkv's (same function, other kernels)

__all__ = [
    "EXTRA_LEN",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "Ct2Translator",
    "ct2_refusal",
    "export_ctranslate2",
    "open_translator",
    "vocabulary",
]


def ct2_refusal(config: TransformerConfig) -> str | None:
    """Why ``config`` has no exact CTranslate2 ``TransformerSpec`` counterpart, or None when it has one.

    Every qkv translation configuration maps today (pre- or post-LN, any positional kind, biases or
    none, relu/gelu/gelu_tanh); the check guards options qkv may add later."""
    if config.activation not in ("relu", "gelu", "gelu_tanh"):
        return f"activation={config.activation!r}: CTranslate2 has no activation of that name"
    if config.positional not in ("sinusoidal", "learned", "none"):
        return f"positional={config.positional!r}: no CTranslate2 position table for it"
    changed = changed_from_default(config, config.OPTIONAL_FIELDS)
    if changed:
        return f"{changed[0]}: CTranslate2 has no counterpart of this option of qkv 2.0"
    return None


def as_numpy(t: Tensor) -> np.ndarray:
    """A tensor as the float32 NumPy array CTranslate2's specs hold."""
    return t.detach().float().cpu().contiguous().numpy()


def set_linear(spec: Any, weight: Tensor, bias: Tensor | None) -> None:
    """Fill a CTranslate2 linear spec (a bias-free qkv projection leaves its optional bias unset)."""
    spec.weight = as_numpy(weight)
    if bias is not None:
        spec.bias = as_numpy(bias)


def set_norm(spec: Any, norm: Any) -> None:
    """Fill a CTranslate2 norm spec: a LayerNorm's weight and bias, or an RMSNorm's weight (no beta)."""
    spec.gamma = as_numpy(norm.weight)
    if getattr(norm, "bias", None) is not None:
        spec.beta = as_numpy(norm.bias)


def _self_attention(spec: Any, attn: Any) -> None:
    """qkv's q/k/v projections fused in CTranslate2's order (q, k, v) into its first linear."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight for p in projs])
    bias = torch.cat([p.bias for p in projs]) if attn.q_proj.bias is not None else None
    set_linear(spec.linear[0], weight, bias)
    set_linear(spec.linear[1], attn.out_proj.weight, attn.out_proj.bias)


def _cross_attention(spec: Any, attn: Any) -> None:
    """Queries alone, then keys and values fused (CTranslate2 projects the memory once)."""
    set_linear(spec.linear[0], attn.q_proj.weight, attn.q_proj.bias)
    bias = torch.cat([attn.k_proj.bias, attn.v_proj.bias]) if attn.k_proj.bias is not None else None
    set_linear(spec.linear[1], torch.cat([attn.k_proj.weight, attn.v_proj.weight]), bias)
    set_linear(spec.linear[2], attn.out_proj.weight, attn.out_proj.bias)


def _ffn(spec: Any, ff: Any, norm: Any) -> None:
    set_linear(spec.linear_0, ff.linear1.weight, ff.linear1.bias)
    set_linear(spec.linear_1, ff.linear2.weight, ff.linear2.bias)
    set_norm(spec.layer_norm, norm)


def _positions(model: Transformer, embed: Any) -> np.ndarray:
    """The table the embedding adds: qkv's sinusoids as qkv lays them out, a learned table, or zeros."""
    config = model.config
    positional = embed.positional
    if config.positional == "sinusoidal":
        return as_numpy(positional.table)
    if config.positional == "learned":
        return as_numpy(positional.embedding.weight)
    return np.zeros((config.max_len, config.d_model), dtype=np.float32)  # "none": adds nothing


def build_spec(model: Transformer) -> Any:
    """A CTranslate2 ``TransformerSpec`` computing what ``model`` computes (weights filled, no vocabulary).

    Raises:
        ValueError: the configuration has no exact counterpart (one line naming the field).
    """
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    reason = ct2_refusal(config)
    if reason is not None:
        raise ValueError(f"cannot export to CTranslate2: {reason}")
    activation = {
        "relu": common_spec.Activation.RELU,
        "gelu": common_spec.Activation.GELU,  # erf GELU, as torch's default
        "gelu_tanh": common_spec.Activation.GELUTanh,
    }[config.activation]
    options = dict(pre_norm=config.norm_first, activation=activation)
    encoder = transformer_spec.TransformerEncoderSpec(config.num_encoder_layers, config.num_heads, **options)
    decoder = transformer_spec.TransformerDecoderSpec(config.num_decoder_layers, config.num_heads, **options)
    for side, embed in ((encoder, model.src_embed), (decoder, model.tgt_embed)):
        side.scale_embeddings = True  # qkv multiplies the token embedding by sqrt(d_model) too
        side.position_encodings.encodings = _positions(model, embed)
    encoder.embeddings[0].weight = as_numpy(model.src_embed.embedding.weight)
    decoder.embeddings.weight = as_numpy(model.tgt_embed.embedding.weight)
    decoder.projection.weight = as_numpy(model.output_proj.weight)  # qkv's output projection has no bias
    if config.norm_first:  # pre-LN stacks end with a LayerNorm, as CTranslate2's pre_norm does
        set_norm(encoder.layer_norm, model.encoder.norm)
        set_norm(decoder.layer_norm, model.decoder.norm)
    for spec, layer in zip(encoder.layer, model.encoder.layers, strict=True):
        _self_attention(spec.self_attention, layer.self_attn)
        set_norm(spec.self_attention.layer_norm, layer.norm1)
        _ffn(spec.ffn, layer.feed_forward, layer.norm2)
    for spec, layer in zip(decoder.layer, model.decoder.layers, strict=True):
        _self_attention(spec.self_attention, layer.self_attn)
        set_norm(spec.self_attention.layer_norm, layer.norm1)
        _cross_attention(spec.attention, layer.cross_attn)
        set_norm(spec.attention.layer_norm, layer.norm2)
        _ffn(spec.ffn, layer.feed_forward, layer.norm3)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    return spec


def _check_folder(model: Transformer, tokenizer: Tokenizer, folder: Path) -> float:
    """Teacher-forced log-probabilities of the saved folder vs qkv's on a few fixed pairs: ``ValueError``
    beyond :data:`CHECK_TOL` so that nothing that differs from the run is put in place. Returns the largest."""
    translator = Ct2Translator(folder)
    generator = torch.Generator().manual_seed(0)
    first, high = len(SPECIALS), min(model.config.src_vocab_size, model.config.tgt_vocab_size)
    src = torch.randint(first, high, (2, 6), generator=generator)
    src[:, -1] = tokenizer.eos_id
    tgt = torch.randint(first, high, (2, 5), generator=generator)
    result = translator.translator.score_batch(
        [translator.to_tokens(row.tolist()) for row in src], [translator.to_tokens(row.tolist()) for row in tgt]
    )
    tgt_in = torch.cat([torch.full((2, 1), tokenizer.bos_id), tgt], dim=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(src, tgt_in).float(), dim=-1)  # (2, 6, V)
    gold = torch.cat([tgt, torch.full((2, 1), tokenizer.eos_id)], dim=1)  # CTranslate2 scores EOS too
    ours = logprobs.gather(-1, gold[..., None])[..., 0]
    theirs = torch.tensor([r.log_probs for r in result])
    worst = float((ours - theirs).abs().max())
    if not worst <= CHECK_TOL:  # NaN fails too
        raise ValueError(f"the CTranslate2 model differs from the run by {worst:.2e} (> {CHECK_TOL}); nothing written")
    return worst


def _manifest_decode(config: dict) -> dict:
    """The run's saved beam size and alpha, with the only length-penalty form CTranslate2 has."""
    return DecodeConfig.of_run(config, penalty="power").saved()


def write_model(
    model: Transformer, tokenizer: Tokenizer, folder: Path, *, decode: dict, quantization: str = "float32"
) -> None:
    """Save ``model`` (float32, eval mode) into ``folder`` with CTranslate2, and :data:`MANIFEST`; the
    caller adds ``tokenizer.json``. ``decode``: the manifest's ``{"beam_size", "alpha", "penalty"}``
    (:meth:`~qkv.inference.decode.DecodeConfig.saved`; CTranslate2's form is ``"power"``)."""
    spec = build_spec(model)
    spec.register_source_vocabulary(vocabulary(tokenizer, model.config.src_vocab_size))
    spec.register_target_vocabulary(vocabulary(tokenizer, model.config.tgt_vocab_size))
    _, bos, eos, unk = SPECIALS
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = unk, bos, eos
    spec.config.decoder_start_token = bos  # qkv's decoder starts from BOS
    spec.config.add_source_bos, spec.config.add_source_eos = False, False  # Ct2Translator adds EOS as qkv does
    spec.validate()
    spec.optimize(quantization=None if quantization == "float32" else quantization)
    spec.save(str(folder))
    manifest = {
        "qkv_ct2": MANIFEST_FORMAT,
        "quantization": quantization,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "max_len": model.config.max_len,
        "vocab_size": max(model.config.src_vocab_size, model.config.tgt_vocab_size),
        "extra_len": EXTRA_LEN,
        "decode": decode,
    }
    write_json(folder / MANIFEST, manifest)


def check_model(model: Transformer, tokenizer: Tokenizer, folder: Path, *, quantization: str) -> None:
    """A float32 folder must score as ``model`` does (:func:`_check_folder`); a quantized one computes
    something else by design, so it must load and translate."""
    if quantization == "float32":
        _check_folder(model, tokenizer, folder)
    else:
        Ct2Translator(folder).translate(["1"], beam_size=1)


def check_output_folder(out: str | Path, *, overwrite: bool, run_dir: str | Path | None = None) -> Path:
    """``out`` must not exist, be empty, or (with ``overwrite``) hold an earlier CTranslate2 export and
    nothing else (:func:`qkv.export.output.check_output_folder`). Returns the path to build at."""
    return check_export_folder(out, overwrite=overwrite, kind="ctranslate2", run_dir=run_dir)


def export_ctranslate2(
    run_dir: str | Path,
    out: str | Path,
    *,
    weights: str = "model",
    quantization: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Export a translation run as a CTranslate2 model folder (:class:`Ct2Translator` translates with it).

    Args:
        run_dir: a translation run folder.
        out: the folder to write: must not exist or be empty, unless ``overwrite`` replaces an earlier export.
        weights: which of the run's weights: ``model`` (averaged/final), ``best``, ``last`` or ``ema``.
        quantization: the stored weight type, one of :data:`QUANTIZATIONS` (float32 is exact; int8 is smaller
            and faster, and its translations may differ).
        overwrite: replace an earlier CTranslate2 export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: a language-model run, a configuration without a counterpart, or ``out`` is taken.
        PermissionError: ``out`` cannot be written (checked before any work).
        FileNotFoundError: ``run_dir`` is not a run folder, or lacks the weights.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, config = load_run(run_dir, weights, task=SEQ2SEQ.name)
    assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # a translation run's, load_run checked
    with building_export(target, kind="ctranslate2", tag="ct2") as tmp:
        write_model(model.float().eval(), tokenizer, tmp, decode=_manifest_decode(config), quantization=quantization)
        shutil.copyfile(Path(run_dir) / "tokenizer.json", tmp / "tokenizer.json")
        check_model(model, tokenizer, tmp, quantization=quantization)
    return out


@contextmanager
def open_translator(
    source: str | Path, *, weights: str = "model", device: str = "cpu", threads: int = 0, compute_type: str = "default"
) -> Iterator[Ct2Translator]:
    """A :class:`Ct2Translator` for ``source``: a folder of :func:`export_ctranslate2`, or a translation run
    converted (float32, checked as the export checks it) into a temporary folder removed on leaving; the
    run folder is only read. ``weights``: the run's weights to convert (an export holds one set);
    the rest go to ``ctranslate2.Translator`` (``compute_type`` "default": the folder's stored type).

    Raises:
        ValueError: ``weights`` other than ``model`` with an export, or what :func:`export_ctranslate2` refuses.
    """
    source = Path(source)
    if (source / MANIFEST).is_file():
        if weights != "model":
            raise ValueError(
                f"{source}: a CTranslate2 export holds one set of weights; --weights {weights} needs a run"
            )
        yield Ct2Translator(source, device=device, threads=threads, compute_type=compute_type)
        return
    with tempfile.TemporaryDirectory(prefix="qkv-ct2-") as tmp:
        folder = export_ctranslate2(source, Path(tmp) / "model", weights=weights)
        yield Ct2Translator(folder, device=device, threads=threads, compute_type=compute_type)
