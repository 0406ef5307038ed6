"""``MarianMTModel`` folders (the ones ``qkv export RUN --to hf`` writes) read back into qkv's
:class:`~qkv.Transformer`, and the tensor map both directions share.

Marian and qkv's post-LN Transformer compute the same function; one layout differs. qkv
interleaves its sinusoids (sin in even dimensions, cos in odd ones), Marian puts all sines first.
A Marian tensor is a qkv tensor in Marian's basis of the residual stream: the d_model dimensions
reordered by :func:`residual_permutation` on the side of every weight that reads or writes the
stream (:func:`marian_key_map` says which side). Reading a folder undoes the permutation.

qkv reads the folders it writes: a ``tokenizer.json`` with qkv's special tokens (``<pad> <s> </s>
<unk>`` at ids 0-3), a decoder that starts from ``<s>`` and no logits bias. A Marian folder from
elsewhere (OPUS-MT's SentencePiece vocabularies, a ``final_logits_bias``) is refused in one line.
No Hugging Face modelling code runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.data.tokenizer import Tokenizer
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.pretrained.bert import check_key_sets
from qkv.pretrained.gpt2 import GPT2_ACTIVATIONS
from qkv.runtime.device import pick_device
from qkv.runtime.safe_load import check_fits_weights, check_layer_counts

logger = logging.getLogger(__name__)

# the residual-stream side of a tensor: "in" its columns (dim 1), "out" its rows or entries (dim 0)
Side = Literal["in", "out", "none"]


@dataclass(frozen=True)
class MarianTensor:
    """Where one Marian tensor comes from in qkv: the parameter ``qkv`` and the ``side`` on which
    it touches the residual stream (the side that is permuted)."""

    qkv: str
    side: Side


def residual_permutation(d_model: int) -> Tensor:
    """Indices ``perm`` with ``marian_vector = qkv_vector[..., perm]``: qkv's even dimensions
    (sines) first, then its odd ones (cosines), Marian's sinusoid layout."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _attention_map(out: dict[str, MarianTensor], hf: str, qkv: str) -> None:
    for proj in ("q_proj", "k_proj", "v_proj"):  # read the stream: columns
        out[f"{hf}.{proj}.weight"] = MarianTensor(f"{qkv}.{proj}.weight", "in")
        out[f"{hf}.{proj}.bias"] = MarianTensor(f"{qkv}.{proj}.bias", "none")
    out[f"{hf}.out_proj.weight"] = MarianTensor(f"{qkv}.out_proj.weight", "out")  # writes it: rows
    out[f"{hf}.out_proj.bias"] = MarianTensor(f"{qkv}.out_proj.bias", "out")


def _layer_rest_map(out: dict[str, MarianTensor], hf: str, qkv: str, norms: Mapping[str, str]) -> None:
    out[f"{hf}.fc1.weight"] = MarianTensor(f"{qkv}.feed_forward.linear1.weight", "in")
    out[f"{hf}.fc1.bias"] = MarianTensor(f"{qkv}.feed_forward.linear1.bias", "none")
    out[f"{hf}.fc2.weight"] = MarianTensor(f"{qkv}.feed_forward.linear2.weight", "out")
    out[f"{hf}.fc2.bias"] = MarianTensor(f"{qkv}.feed_forward.linear2.bias", "out")
    for marian_norm, qkv_norm in norms.items():
        for param in ("weight", "bias"):
            out[f"{hf}.{marian_norm}.{param}"] = MarianTensor(f"{qkv}.{qkv_norm}.{param}", "out")


def marian_key_map(config: TransformerConfig) -> dict[str, MarianTensor]:
    """``MarianMTModel`` tensor name -> its qkv source, for every tensor a saved folder holds but
    the logits bias (zeros) and Marian's own sinusoid tables. Embeddings follow the folder's
    saving rules: one ``model.shared.weight`` for shared embeddings, an ``lm_head.weight`` only
    when the output projection is not tied."""
    out: dict[str, MarianTensor] = {}
    if config.share_embeddings:
        out["model.shared.weight"] = MarianTensor("src_embed.embedding.weight", "in")
    else:
        out["model.encoder.embed_tokens.weight"] = MarianTensor("src_embed.embedding.weight", "in")
        out["model.decoder.embed_tokens.weight"] = MarianTensor("tgt_embed.embedding.weight", "in")
    if not config.tie_output:
        out["lm_head.weight"] = MarianTensor("output_proj.weight", "in")
    for i in range(config.num_encoder_layers):
        hf, qkv = f"model.encoder.layers.{i}", f"encoder.layers.{i}"
        _attention_map(out, f"{hf}.self_attn", f"{qkv}.self_attn")
        _layer_rest_map(out, hf, qkv, {"self_attn_layer_norm": "norm1", "final_layer_norm": "norm2"})
    for i in range(config.num_decoder_layers):
        hf, qkv = f"model.decoder.layers.{i}", f"decoder.layers.{i}"
        _attention_map(out, f"{hf}.self_attn", f"{qkv}.self_attn")
        _attention_map(out, f"{hf}.encoder_attn", f"{qkv}.cross_attn")
        norms = {"self_attn_layer_norm": "norm1", "encoder_attn_layer_norm": "norm2", "final_layer_norm": "norm3"}
        _layer_rest_map(out, hf, qkv, norms)
    return out


def to_marian(tensor: Tensor, side: Side, perm: Tensor) -> Tensor:
    """A qkv tensor in Marian's residual basis."""
    return tensor[:, perm] if side == "in" else tensor[perm] if side == "out" else tensor


def from_marian(tensor: Tensor, side: Side, perm: Tensor) -> Tensor:
    """A Marian tensor back in qkv's residual basis (the inverse of :func:`to_marian`)."""
    inverse = torch.argsort(perm)
    return tensor[:, inverse] if side == "in" else tensor[inverse] if side == "out" else tensor


def _field(data: Mapping[str, Any], name: str) -> Any:
    if data.get(name) is None:
        raise ValueError(f"{name} is missing")
    return data[name]


def marian_transformer_config(data: Mapping[str, Any]) -> TransformerConfig:
    """The :class:`~qkv.TransformerConfig` of a ``MarianMTModel`` ``config.json`` dict.

    Raises:
        ValueError: not a Marian config, or one qkv's Transformer cannot express (one line naming the field).
    """
    if data.get("model_type") != "marian":
        raise ValueError(f"not a Marian config: model_type={data.get('model_type')!r}")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if data.get(a) != data.get(b):
            raise ValueError(f"{a}={data.get(a)} differs from {b}={data.get(b)}; qkv's layers share one value")
    if data.get("scale_embedding") is not True:
        raise ValueError("scale_embedding is not true; qkv scales the embedding by sqrt(d_model)")
    activation = data.get("activation_function", "gelu")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"activation_function={activation!r}: qkv has {sorted(GPT2_ACTIVATIONS)}")
    vocab = _field(data, "vocab_size")
    try:
        return TransformerConfig(
            src_vocab_size=vocab,
            tgt_vocab_size=data.get("decoder_vocab_size") or vocab,
            d_model=_field(data, "d_model"),
            num_heads=_field(data, "encoder_attention_heads"),
            num_encoder_layers=_field(data, "encoder_layers"),
            num_decoder_layers=_field(data, "decoder_layers"),
            d_ff=_field(data, "encoder_ffn_dim"),
            dropout=float(data.get("dropout", 0.1)),
            attention_dropout=float(data.get("attention_dropout", 0.0)),
            activation=GPT2_ACTIVATIONS[activation],
            norm_first=False,  # Marian's layers are post-LN
            max_len=_field(data, "max_position_embeddings"),
            positional="sinusoidal",
            share_embeddings=data.get("share_encoder_decoder_embeddings", True) is not False,
            tie_output=data.get("tie_word_embeddings", True) is not False,
            pad_id=_field(data, "pad_token_id"),
        )
    except TypeError as err:  # a field of the wrong kind or missing
        raise ValueError(str(err).splitlines()[0]) from None


class PretrainedTransformer(Transformer):
    """A :class:`~qkv.Transformer` read from a Marian folder, with the folder's tokenizer and
    name (both set by :func:`load_marian`)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.tokenizer: Tokenizer | None = None
        self.name = ""


def _check_logits_bias(state: Mapping[str, Tensor], source: str) -> None:
    bias = state.get("final_logits_bias")
    if bias is not None and bool(bias.float().abs().max() > 0):
        raise ValueError(f"{source}: final_logits_bias is not zero; qkv's Transformer has no logits bias")


def build_marian_transformer(
    config: TransformerConfig, state: Mapping[str, Tensor], *, source: str = "checkpoint"
) -> PretrainedTransformer:
    """Build a :class:`~qkv.Transformer` and copy a Marian ``state`` into it through
    :func:`marian_key_map`, back in qkv's residual basis.

    Args:
        config: the architecture (from :func:`marian_transformer_config`).
        state: ``MarianMTModel`` tensors by name, as ``save_pretrained`` writes them (tied copies
            and the sinusoid tables may be present: they are not read).
        source: how to name the weights in error messages.

    Raises:
        ValueError: keys missing or unexpected, a shape that disagrees with the config, a nonzero
            logits bias (one line naming them).
    """
    _check_logits_bias(state, source)
    # a hostile config.json must not make qkv build what the weights cannot fill: the layer counts first
    # (the key map and the model grow with them), then the model's memory against the weights' on the
    # meta device (a positional table sized by max_position_embeddings, say), as the GPT-2 loader does
    check_layer_counts(
        state,
        {
            "encoder_layers": ("model.encoder.layers.", config.num_encoder_layers),
            "decoder_layers": ("model.decoder.layers.", config.num_decoder_layers),
        },
        config_path="config.json",
        weights_path=source,
        only_more=True,
    )
    with torch.device("meta"):
        probe = PretrainedTransformer(config)
    check_fits_weights(
        probe, sum(t.numel() * 4 for t in state.values()), config_path="config.json", weights_path=source
    )
    del probe
    key_map = marian_key_map(config)
    ignored = {"final_logits_bias", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    ignored |= {"lm_head.weight"} if config.tie_output else set()
    given = {k: v for k, v in state.items() if ".embed_positions." not in k and (k in key_map or k not in ignored)}
    check_key_sets(given, key_map, source, "Marian")
    model = PretrainedTransformer(config)
    params = dict(model.state_dict())
    perm = residual_permutation(config.d_model)
    wrong = []
    loaded = {}
    for hf, entry in key_map.items():
        tensor = given[hf]
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{source}: {hf} has dtype {tensor.dtype}, expected a floating-point tensor")
        if tuple(tensor.shape) != tuple(params[entry.qkv].shape):
            wrong.append(f"{hf} {tuple(tensor.shape)} vs expected {tuple(params[entry.qkv].shape)}")
            continue
        loaded[entry.qkv] = from_marian(tensor, entry.side, perm)
    if wrong:
        raise ValueError(f"{source}: tensor shapes disagree with config.json: {', '.join(wrong[:4])}")
    if config.share_embeddings:  # one table read, both sides use it
        loaded["tgt_embed.embedding.weight"] = loaded["src_embed.embedding.weight"]
    if config.tie_output:
        loaded["output_proj.weight"] = loaded["tgt_embed.embedding.weight"]
    missing = sorted(name for name in params if name not in loaded)
    if missing:  # the map is the contract with qkv's Transformer; guard it
        raise RuntimeError(f"marian_key_map leaves qkv parameters unset: {missing[:4]}")
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return model.eval()


def _marian_tokenizer(folder: Path, data: Mapping, config: TransformerConfig) -> Tokenizer:
    """The folder's ``tokenizer.json`` as qkv's :class:`~qkv.data.tokenizer.Tokenizer`, checked
    against ``config.json``'s special ids and vocabulary sizes."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder}: no tokenizer.json; qkv reads the Marian folders `qkv export --to hf` writes "
            "(a SentencePiece Marian folder is not one)"
        )
    tokenizer = Tokenizer.load(path)  # ValueError unless <pad> <s> </s> <unk> are ids 0-3
    expected = {"decoder_start_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": 0}
    for field, want in expected.items():
        if data.get(field) != want:
            raise ValueError(
                f"{folder / 'config.json'}: {field}={data.get(field)}, but qkv's decoder needs {want} "
                "(the tokenizer's id); not a folder qkv wrote"
            )
    if tokenizer.vocab_size > min(config.src_vocab_size, config.tgt_vocab_size):
        raise ValueError(
            f"{path}: {tokenizer.vocab_size} tokens, more than config.json's vocabularies "
            f"({config.src_vocab_size}, {config.tgt_vocab_size}); the files do not belong together"
        )
    return tokenizer


def load_marian(
    folder: str | Path, device: str | torch.device | None = None
) -> tuple[PretrainedTransformer, Tokenizer]:
    """Read a ``MarianMTModel`` folder written by ``qkv export --to hf`` into qkv's :class:`~qkv.Transformer`.

    Args:
        folder: holds ``config.json`` (``"model_type": "marian"``), ``model.safetensors`` (or
            ``pytorch_model.bin``) and ``tokenizer.json``.
        device: where to put the model (default: CUDA when available, else the CPU).

    Returns:
        ``(model in eval mode, tokenizer)``; the tokenizer is also ``model.tokenizer``.

    Raises:
        FileNotFoundError: the folder or a file is missing.
        ValueError: a configuration or tokenizer qkv cannot read, corrupt weights, keys or shapes
            that disagree with the config (one line naming them).
    """
    from qkv.pretrained import read_config_dict, read_weights  # here: the package imports this module

    device = pick_device(device)
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: checkpoint folder not found")
    data = read_config_dict(folder)
    try:
        config = marian_transformer_config(data)
    except ValueError as err:
        raise ValueError(f"{folder / 'config.json'}: {err}") from None
    tokenizer = _marian_tokenizer(folder, data, config)
    state, weights_file = read_weights(folder)
    model = build_marian_transformer(config, state, source=str(weights_file))
    model.tokenizer, model.name = tokenizer, folder.name
    logger.debug("loaded Marian %s (d=%d) from %s", folder.name, config.d_model, weights_file)
    return model.to(device), tokenizer


__all__ = [
    "MarianTensor",
    "PretrainedTransformer",
    "build_marian_transformer",
    "from_marian",
    "load_marian",
    "marian_key_map",
    "marian_transformer_config",
    "residual_permutation",
    "to_marian",
]
