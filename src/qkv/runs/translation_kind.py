"""The translation run kind's training hooks (:data:`~qkv.runs.kinds.TRANSLATION`, registered in
:mod:`qkv.runs.kinds`, calls them): an encoder-decoder trained on pairs of sentences.

A translation run reads its pairs from a prepared folder (:mod:`qkv.data.prepared`): the one it was
started on (``--prepared DIR``, recorded with its fingerprint), or, for text files, Multi30k or the
date task, its own copy in ``data/`` inside the run folder, written with it (its fingerprint
recorded too). The first session trains from the pairs it has just tokenised; resuming, and every
process of a multi-process run, reads the prepared folder a batch at a time, so a process holds
O(batch) token data. A prepared folder is verified against its manifest (its arrays' SHA-256, their
offsets, lengths and ids: :meth:`~qkv.data.prepared.PreparedCorpus.verify`) when a run starts on it
and whenever a run resumes from one (every file hashed again then, whatever the folder's hash cache
says), so a fingerprint equal to the run's means the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from qkv.data.sources import check_spec, open_training_data
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import Tokenizer
from qkv.models.options import check_trainable
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs import folder as run_folder
from qkv.runs.kinds import TRANSLATION
from qkv.runs.recipes import Recipe, decode_settings
from qkv.runs.recipes.choice import RecipeChoice
from qkv.runs.resolve import ResolvedOptions, as_resolved
from qkv.runs.translation_data import RUN_DATA_FOLDER, open_translation_task, write_run_data
from qkv.runtime.device import pick_device
from qkv.training import Trainer, TranslationTask
from qkv.training.tasks import TokenLists

logger = logging.getLogger(__name__)


def _model_config(recipe: Recipe, model_options: dict | None, vocab_size: int, pad_id: int) -> TransformerConfig:
    """The recipe's model with the explicit options over it; vocabulary sizes and ``pad_id`` are the tokenizer's."""
    known = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(model_options or {}) - known)
    if unknown:
        raise ValueError(f"unknown model options: {unknown}")
    return TransformerConfig(
        **{
            **recipe.model,
            **(model_options or {}),
            "src_vocab_size": vocab_size,
            "tgt_vocab_size": vocab_size,
            "pad_id": pad_id,
        }
    )


def start_translation_run(
    run_dir: Path,
    *,
    data: DataSpec,
    model_options: dict | None,
    train_options: dict | ResolvedOptions | None,
    vocab_size: int | None,
    overwrite: bool,
    device: str | torch.device | None,
    decode: dict | None,
    choice: RecipeChoice,
) -> Trainer:
    """:func:`start_run` for translation: check the options and inputs, read the data
    (:func:`~qkv.data.sources.open_training_data`), build the model, then create the run folder
    with the run's own prepared copy of its pairs (unless it trains on a prepared folder)."""
    check_spec(data)
    recipe = choice.recipe
    device = pick_device(device)
    run_folder.check_new_run_dir(run_dir, overwrite=overwrite, inputs=data.input_files())
    if data.source != "prepared":  # a prepared folder's tokenizer is its own
        vocab_size = recipe.vocab_size if vocab_size is None else vocab_size
    _check_vocab_size(vocab_size)
    _model_config(recipe, model_options, vocab_size or 260, 0)  # the model options' own checks, before reading data
    resolved = as_resolved(recipe, train_options, device=device)
    train_config = resolved.train_config()  # bf16 as the resolve step decided it for this machine
    train_config.check_stops()

    training = open_training_data(data, vocab_size=vocab_size, split_digits=recipe.split_digits)
    tokenizer = training.tokenizer
    resolved.say(logger)  # the options as resolved, once the inputs are known to be usable
    for line in choice.start_notes(bf16=train_config.bf16, bf16_fast=bool(resolved.bf16_fast)):
        logger.info(line)
    model_config = _model_config(recipe, model_options, tokenizer.vocab_size, tokenizer.pad_id)
    check_trainable(model_config.matrix_parameters(), device, train_config.strategy)  # before building it
    # leaves out over-long pairs
    task = TranslationTask(
        tokenizer,
        training.train,
        training.valid,
        max_len=model_config.max_len,
        pad_id=model_config.pad_id,
        both_directions=data.both_directions,
    )
    trainer = Trainer(Transformer(model_config).to(device), task, train_config, run_dir)
    corpus = training.corpus
    if corpus is None:  # the run's own copy of its pairs, written below with the run folder
        prepared = {"folder": RUN_DATA_FOLDER}
    else:
        prepared = {"folder": str(corpus.folder.resolve()), "fingerprint": corpus.fingerprint}
    config = {
        "model": asdict(model_config),
        "train": asdict(train_config),
        "data": data.to_json(),
        "data_fingerprint": training.fingerprint,
        "prepared": prepared,
        "decode": decode_settings({"decode": dict(recipe.decode)}) | (decode or {}),
        "recipe": choice.record(),
    }

    def write_initial(folder: Path) -> None:
        if corpus is None:  # the run's own prepared copy: resuming and other processes read it
            assert isinstance(task.pairs, TokenLists)  # pairs read from text are held in memory
            manifest = write_run_data(folder / RUN_DATA_FOLDER, tokenizer, task.pairs, training.valid, data)
            prepared["fingerprint"] = manifest["fingerprint"]  # known once the copy is written: a resume compares it
            run_folder.write_config(folder, config)
        trainer.save(folder)

    inputs = data.input_files()
    run_folder.create_run(run_dir, config, tokenizer, overwrite=overwrite, write_initial=write_initial, inputs=inputs)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    logger.info("model: %.1fM parameters; run folder %s", parameters / 1e6, run_dir)
    return trainer


def _check_vocab_size(vocab_size: object) -> None:
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 260):
        raise ValueError(
            f"vocab_size (--vocab-size) must be an integer >= 260 (256 bytes + 4 specials), got {vocab_size!r}"
        )


def start_options(data: DataSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """A translation run's own start option (``decode``); a language model's options are refused.

    Args:
        data: the run's data.
        options: ``lm_options`` and ``decode`` as given to :func:`~qkv.runs.lifecycle.start_run`.

    Returns:
        The keywords for :func:`start_translation_run`.

    Raises:
        ValueError: a language model's option was given.
    """
    if options.get("lm_options"):
        raise ValueError(
            f"{', '.join(sorted(options['lm_options']))}: options of a language model (--data tinyshakespeare or --train-text)"
        )
    return {"decode": options.get("decode")}


def open_task(run_dir: Path, config: dict, model_config: Any) -> TranslationTask:
    """The task of a translation run being resumed (its prepared pairs, checked).

    Args:
        run_dir: the run folder.
        config: its config.json, read.
        model_config: its model's config (:func:`~qkv.runs.folder.read_model_config`).

    Returns:
        The :class:`~qkv.training.TranslationTask`.
    """
    assert isinstance(model_config, TransformerConfig)  # read_model_config: a translation run's
    return open_translation_task(run_dir, config, Tokenizer.load(run_dir / "tokenizer.json"), model_config)


__all__ = ["TRANSLATION", "open_task", "start_options", "start_translation_run"]
