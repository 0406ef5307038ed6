"""Opening a run folder for inference: its config, its tokenizer and its model with the chosen
weights, each checked before anything large is built or read (:mod:`qkv.runtime.safe_load`).

This is the loading half of what a run folder is; creating and replacing one is
:mod:`qkv.runs.folder` (above the trainer), which re-exports these names. Nothing here imports
:mod:`qkv.training`: ``qkv translate``, ``qkv serve`` and the exporters open runs through this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import NamedTuple

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.ensemble import Ensemble, same_tokenizer
from qkv.inference.kinds import SEQ2SEQ, kind_name, model_kind
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.models.weights import load_weights
from qkv.runtime.fileio import read_json
from qkv.runtime.safe_load import build_within_weights, check_layer_counts, weights_header

RUN_MARKER = "qkv_run"  # config.json key that marks a qkv run folder; its value is the format version

__all__ = [
    "RUN_MARKER",
    "OpenRun",
    "build_run_model",
    "is_run_folder",
    "load_run",
    "load_translator",
    "open_run",
    "read_model_config",
    "read_run_config",
    "run_task",
]


class OpenRun(NamedTuple):
    """A run opened for inference (unpacks as ``model, tokenizer, config``, as qkv 1.x's ``load_run``)."""

    model: Transformer | CausalLM  # in eval mode, on the CPU
    tokenizer: Tokenizer | CharTokenizer
    config: dict  # the run's config.json


def is_run_folder(path: str | Path) -> bool:
    """True when ``path`` holds a config.json that marks it as a qkv run (or a run made before the
    marker existed: a config with model, train and data sections next to tokenizer.json)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    if RUN_MARKER in config:
        return True
    return {"model", "train", "data"} <= set(config) and (Path(path) / "tokenizer.json").is_file()


def read_run_config(run_dir: str | Path) -> dict:
    """The run folder's ``config.json``; ``FileNotFoundError`` if it is not a run folder."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a qkv run folder (config.json missing)")
    config = read_json(path)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{path}: not a qkv run config (no 'model' section)")
    return config


def run_task(config: dict) -> str:
    """What a run's model does: the name of its kind (:mod:`qkv.inference.kinds`), ``"translation"``
    (an encoder-decoder) or ``"lm"`` (a language model).

    Args:
        config: the run's config.json, read.

    Returns:
        config.json's ``"task"``, or the default kind's name where it has none.
    """
    return kind_name(config)


def open_run(run_dir: str | Path, weights: str = "model", *, task: str | None = None) -> OpenRun:
    """Open a trained run for inference: a translation model or a language model, after every check.

    Args:
        run_dir: the run folder.
        weights: ``model`` (averaged/final; falls back to ``last``), ``best``, ``last`` or ``ema`` (the
            moving average of a run trained with ``--ema-decay``).
        task: the name of the kind of run the caller can use (a :class:`~qkv.inference.kinds.ModelKind`'s
            ``name``: ``"translation"`` or ``"lm"``); another kind raises ``ValueError`` saying which
            command fits it. None accepts any.

    Returns:
        An :class:`OpenRun`, ``(model in eval mode, tokenizer, config dict)``: a
        :class:`~qkv.models.transformer.Transformer` and its BPE tokenizer, or a
        :class:`~qkv.models.causal_lm.CausalLM` and its character or BPE tokenizer.

    Raises:
        FileNotFoundError / ValueError: a missing or damaged file, in one line naming it.
    """
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    kind = model_kind(config, run_dir / "config.json")
    if task is not None and kind.name != task:
        raise ValueError(f"{run_dir}: {kind.run_words}; use {kind.commands} with it")
    path = run_dir / f"{weights}.safetensors"
    if weights == "model" and not path.is_file():
        path = run_dir / "last.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    model_config = read_model_config(run_dir, config)
    tokenizer = kind.load_tokenizer(run_dir / "tokenizer.json")
    if isinstance(model_config, CausalLMConfig):
        vocab = model_config.vocab_size
    else:
        vocab = min(model_config.src_vocab_size, model_config.tgt_vocab_size)
    if isinstance(tokenizer, CharTokenizer) and tokenizer.vocab_size != vocab:  # a language model's characters
        raise ValueError(
            f"{run_dir / 'tokenizer.json'}: {tokenizer.vocab_size} characters but the model's vocabulary "
            f"in config.json has {vocab}; the files do not belong together"
        )
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"{run_dir / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than the model's "
            f"vocabulary of {vocab} in config.json; the files do not belong together"
        )
    model = build_run_model(run_dir, model_config, path)
    load_weights(model, path)
    model.eval()
    return OpenRun(model, tokenizer, config)


load_run = open_run  # the name qkv 1.x gave it (qkv.runs.folder.load_run)


def read_model_config(run_dir: str | Path, config: dict) -> TransformerConfig | CausalLMConfig:
    """The run's model configuration (:class:`~qkv.models.transformer.TransformerConfig` or
    :class:`~qkv.models.causal_lm.CausalLMConfig`), checked field by field; one-line ``ValueError`` naming
    ``config.json`` otherwise. Nothing is built."""
    kind: type[TransformerConfig] | type[CausalLMConfig]
    kind = model_kind(config, Path(run_dir) / "config.json").model_config
    # qkv has written every field since its first run folder: a missing one is damage, not an older
    # run, and its default would build another model without a word
    # (the fields qkv 2.0 added, OPTIONAL_FIELDS, default to what every earlier run is)
    missing = [f.name for f in fields(kind) if f.name not in config["model"] and f.name not in kind.OPTIONAL_FIELDS]
    if missing:
        raise ValueError(f"{Path(run_dir) / 'config.json'}: the model section lacks {', '.join(missing)}")
    try:
        return kind.from_dict(config["model"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{Path(run_dir) / 'config.json'}: bad model section ({err})") from None


def build_run_model(
    run_dir: str | Path, model_config: TransformerConfig | CausalLMConfig, weights_path: str | Path
) -> Transformer | CausalLM:
    """Build the run's model (weights not loaded) once ``config.json`` has been compared with the
    header of ``weights_path``: layer counts, then every tensor's shape and the memory the model
    needs (:mod:`qkv.runtime.safe_load`), so a copied config asking for 10,000 layers or d_model 10^6 is a
    one-line error in a fraction of a second, not minutes and gigabytes."""
    config_path = Path(run_dir) / "config.json"
    header = weights_header(weights_path)
    if isinstance(model_config, CausalLMConfig):
        layers = {"num_layers": ("decoder.layers.", model_config.num_layers)}
        make: Callable[[], Transformer | CausalLM] = partial(CausalLM, model_config)
    else:
        layers = {
            "num_encoder_layers": ("encoder.layers.", model_config.num_encoder_layers),
            "num_decoder_layers": ("decoder.layers.", model_config.num_decoder_layers),
        }
        make = partial(Transformer, model_config)
    check_layer_counts(header, layers, config_path=config_path, weights_path=weights_path)
    model = build_within_weights(
        make,
        header,
        config_path=config_path,
        weights_path=weights_path,
        fields=vars(model_config),
    )
    assert isinstance(model, (Transformer, CausalLM))  # what make built
    return model


def load_translator(
    run_dirs: Sequence[str | Path], weights: str = "model"
) -> tuple[Transformer | Ensemble, Tokenizer, dict]:
    """Load one translation run, or several as an :class:`Ensemble`.

    Args:
        run_dirs: run folders made by ``qkv train``; the first one's tokenizer and config (its
            recipe's beam and length penalty, its data) speak for the ensemble.
        weights: which weights of every run (see :func:`open_run`).

    Returns:
        ``(model, tokenizer, config)`` as :func:`open_run` returns them.

    Raises:
        ValueError: a run is not a translation run, or its tokenizer differs from the first's.
    """

    model, tokenizer, config = load_run(run_dirs[0], weights, task=SEQ2SEQ.name)
    assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # a translation run's
    if len(run_dirs) == 1:
        return model, tokenizer, config
    models = [model]
    for run_dir in run_dirs[1:]:
        other, other_tokenizer, _ = load_run(run_dir, weights, task=SEQ2SEQ.name)
        assert isinstance(other, Transformer) and isinstance(other_tokenizer, Tokenizer)  # a translation run's
        if not same_tokenizer(tokenizer, other_tokenizer):
            raise ValueError(
                f"{run_dir}: its tokenizer differs from {run_dirs[0]}'s; an ensemble decodes one "
                "vocabulary, so its runs must be trained on the same data (one tokenizer.json)"
            )
        models.append(other)
    return Ensemble(models), tokenizer, config
