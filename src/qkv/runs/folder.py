"""Run folders on disk: weights (safetensors), config (JSON), tokenizer and the resumable
checkpoint, each written atomically (:mod:`qkv.runtime.fileio`).

A run folder holds::

    config.json          {"qkv_run": 2, "model": TransformerConfig fields, "train": TrainConfig fields,
                          "data": {...}, "data_fingerprint": {...}}; a language model's also has
                          "task": "lm", CausalLMConfig fields as "model", and "lm": {tokenizer, windows,
                          splits: where each split came from and its token count}
    tokenizer.json       the joint BPE tokenizer (a language model's: character or BPE)
    train.bin, val.bin,  a language model's token arrays (qkv.data.text); test.bin is never read by
    test.bin             training (only qkv evaluate scores it)
    state.pt             the resumable checkpoint, ONE file: weights, optimizer, step, epoch, position
                         in the epoch, RNG states (what --resume reads)
    last.safetensors     the weights at the last saved step (written after state.pt, from the same step)
    model.safetensors    the weights to translate with (the average of the last checkpoints, if made)
    best.safetensors     the weights with the best validation BLEU
    checkpoints/         step_<N>.safetensors kept for checkpoint averaging
    metrics.jsonl        one JSON object per log/validation event
    curves.png           training loss and validation BLEU against minutes

The ``qkv_run`` key marks a folder as a qkv run: ``--overwrite`` replaces nothing else. Because the
resumable checkpoint is a single file replaced atomically, a crash at any moment leaves either the
previous step's checkpoint or the new one, never weights from one step with the state of another.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import fields
from functools import partial
from pathlib import Path

from qkv.data.text import CharTokenizer, load_text_tokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.ensemble import Ensemble, same_tokenizer
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runtime.fileio import TMP_SUFFIX, atomic_folder, read_json, write_json
from qkv.runtime.safe_load import (
    build_within_weights,
    check_layer_counts,
    weights_header,
)
from qkv.training.checkpoint_files import RUN_FORMAT, load_weights

logger = logging.getLogger(__name__)


RUN_MARKER = "qkv_run"  # config.json key that marks a qkv run folder; its value is the format version


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
    """What a run's model does: ``"translation"`` (an encoder-decoder) or ``"lm"`` (a language model)."""
    return config.get("task", "translation")


def load_run(
    run_dir: str | Path, weights: str = "model", *, task: str | None = None
) -> tuple[Transformer | CausalLM, Tokenizer | CharTokenizer, dict]:
    """Load a trained run: a translation model or a language model.

    Args:
        run_dir: the run folder.
        weights: ``model`` (averaged/final; falls back to ``last``), ``best``, ``last`` or ``ema`` (the
            moving average of a run trained with ``--ema-decay``).
        task: the kind of run the caller can use (``"translation"`` or ``"lm"``); another kind
            raises ``ValueError`` saying which command fits it. None accepts either.

    Returns:
        ``(model in eval mode, tokenizer, config dict)``: a :class:`~qkv.models.transformer.Transformer` and
        its BPE tokenizer, or a :class:`~qkv.models.causal_lm.CausalLM` and its character or BPE tokenizer.

    Raises:
        FileNotFoundError / ValueError: a missing or damaged file, in one line naming it.
    """
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    kind = run_task(config)
    if task is not None and kind != task:
        hint = "qkv generate / qkv evaluate" if kind == "lm" else "qkv translate / qkv evaluate"
        what = "a language-model run" if kind == "lm" else "a translation run"
        raise ValueError(f"{run_dir}: {what}; use {hint} with it")
    path = run_dir / f"{weights}.safetensors"
    if weights == "model" and not path.is_file():
        path = run_dir / "last.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    model_config = read_model_config(run_dir, config)
    tokenizer = (
        load_text_tokenizer(run_dir / "tokenizer.json") if kind == "lm" else Tokenizer.load(run_dir / "tokenizer.json")
    )
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
    return model, tokenizer, config


def read_model_config(run_dir: str | Path, config: dict) -> TransformerConfig | CausalLMConfig:
    """The run's model configuration (:class:`~qkv.models.transformer.TransformerConfig` or
    :class:`~qkv.models.causal_lm.CausalLMConfig`), checked field by field; one-line ``ValueError`` naming
    ``config.json`` otherwise. Nothing is built."""
    kind: type[TransformerConfig] | type[CausalLMConfig] = (
        CausalLMConfig if run_task(config) == "lm" else TransformerConfig
    )
    # qkv has written every field since its first run folder: a missing one is damage, not an older
    # run, and its default would build another model without a word
    missing = [item.name for item in fields(kind) if item.name not in config["model"]]
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


def check_new_run_dir(run_dir: str | Path, *, overwrite: bool, inputs: Sequence[str | Path] = ()) -> None:
    """Check that a new run may be created at ``run_dir``: it does not exist, or ``overwrite`` is
    given and :func:`check_replaceable` allows it. Raises ``ValueError``; deletes nothing."""
    if Path(run_dir).exists():
        if not overwrite:
            raise ValueError(f"{run_dir}: run folder exists; pass --resume to continue it or --overwrite to replace it")
        check_replaceable(run_dir, inputs=inputs)


# what a qkv run writes at the top of its folder (every format since 0.1); anything else there is a
# user's, which ``--overwrite`` must not delete
RUN_ENTRIES = frozenset(
    {
        "config.json",
        "tokenizer.json",
        "state.pt",
        "last.safetensors",
        "model.safetensors",
        "best.safetensors",
        "ema.safetensors",
        "checkpoints",
        "metrics.jsonl",
        "curves.png",
        "data",
        "train.bin",
        "val.bin",
        "test.bin",
    }
)


def foreign_entries(run_dir: str | Path) -> list[str]:
    """The entries at the top of the run folder ``run_dir`` that no qkv run writes: not one of
    :data:`RUN_ENTRIES`, an FSDP optimizer shard folder or a temporary file a killed writer left.

    Args:
        run_dir: an existing run folder.

    Returns:
        Their names, sorted (empty for a folder holding only a run's own files).
    """
    from qkv.training.distributed import SHARDS_PREFIX, SHARDS_SUFFIX

    def written_by_a_run(name: str) -> bool:
        if name in RUN_ENTRIES or (name.startswith(SHARDS_PREFIX) and name.endswith(SHARDS_SUFFIX)):
            return True
        return name.startswith(".") and (name.endswith(TMP_SUFFIX) or name.endswith(".partial"))

    return sorted(p.name for p in Path(run_dir).iterdir() if not written_by_a_run(p.name))


def check_replaceable(run_dir: str | Path, *, inputs: Sequence[str | Path] = ()) -> None:
    """Check that ``--overwrite`` may replace ``run_dir``: it must be a qkv run folder holding only
    what a run writes (:func:`foreign_entries`) or an empty folder, must not hold the current
    directory, and must not hold any of ``inputs`` (the files the new run reads). Raises ``ValueError`` saying which rule failed; deletes nothing."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir() or run_dir.is_symlink():
        raise ValueError(f"{run_dir}: exists and is not a folder; --overwrite only replaces a qkv run folder")
    resolved = run_dir.resolve()
    if not (is_run_folder(run_dir) or not any(run_dir.iterdir())):
        raise ValueError(
            f"{run_dir}: not a qkv run folder (no config.json marked '{RUN_MARKER}') and not empty; "
            "--overwrite only replaces a run folder: choose another --run-dir"
        )
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise ValueError(f"{run_dir}: holds the current directory; --overwrite will not replace it")
    for item in inputs:
        if item and (resolved == Path(item).resolve() or resolved in Path(item).resolve().parents):
            raise ValueError(
                f"{item}: the new run reads this file, and it lies inside {run_dir}, which "
                "--overwrite would replace; move it or choose another --run-dir"
            )
    others = foreign_entries(run_dir)
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(
            f"{run_dir}: holds {listed}, which no qkv run writes; --overwrite would delete them: move them "
            "or choose another --run-dir"
        )


def create_run(
    run_dir: str | Path,
    config: dict,
    tokenizer: Tokenizer | CharTokenizer,
    *,
    overwrite: bool = False,
    write_initial: Callable[[Path], None] | None = None,
    inputs: Sequence[str | Path] = (),
) -> Path:
    """Create a run folder holding ``config.json`` (marked as a qkv run) and ``tokenizer.json``.

    The folder is assembled under a temporary name (with ``write_initial(folder)`` adding e.g. the
    step-0 checkpoint) and renamed into place, so a failure never leaves a half-made run folder.
    With ``overwrite``, an existing run folder (see :func:`check_replaceable`) is replaced only
    once the new one is complete.

    Raises:
        ValueError: ``run_dir`` exists and ``overwrite`` is False, or it may not be replaced.
    """
    run_dir = Path(run_dir)
    if run_dir.exists():
        if not overwrite:
            raise ValueError(f"{run_dir}: run folder exists; pass --resume to continue it or --overwrite to replace it")
        check_replaceable(run_dir, inputs=inputs)
    with atomic_folder(run_dir, tag="new") as tmp:
        write_json(tmp / "config.json", {RUN_MARKER: RUN_FORMAT, **config})
        tokenizer.save(tmp / "tokenizer.json")
        (tmp / "checkpoints").mkdir()
        if write_initial is not None:
            write_initial(tmp)
    return run_dir


def write_config(run_dir: str | Path, config: dict) -> None:
    """Rewrite a run's ``config.json`` (atomically), keeping the run marker."""
    write_json(Path(run_dir) / "config.json", {RUN_MARKER: config.get(RUN_MARKER, RUN_FORMAT), **config})


def load_translator(
    run_dirs: Sequence[str | Path], weights: str = "model"
) -> tuple[Transformer | Ensemble, Tokenizer, dict]:
    """Load one translation run, or several as an :class:`Ensemble`.

    Args:
        run_dirs: run folders made by ``qkv train``; the first one's tokenizer and config (its
            recipe's beam and length penalty, its data) speak for the ensemble.
        weights: which weights of every run (see :func:`qkv.runs.folder.load_run`).

    Returns:
        ``(model, tokenizer, config)`` as :func:`~qkv.runs.folder.load_run` returns them.

    Raises:
        ValueError: a run is not a translation run, or its tokenizer differs from the first's.
    """

    model, tokenizer, config = load_run(run_dirs[0], weights, task="translation")
    assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # a translation run's
    if len(run_dirs) == 1:
        return model, tokenizer, config
    models = [model]
    for run_dir in run_dirs[1:]:
        other, other_tokenizer, _ = load_run(run_dir, weights, task="translation")
        assert isinstance(other, Transformer) and isinstance(other_tokenizer, Tokenizer)  # a translation run's
        if not same_tokenizer(tokenizer, other_tokenizer):
            raise ValueError(
                f"{run_dir}: its tokenizer differs from {run_dirs[0]}'s; an ensemble decodes one "
                "vocabulary, so its runs must be trained on the same data (one tokenizer.json)"
            )
        models.append(other)
    return Ensemble(models), tokenizer, config
