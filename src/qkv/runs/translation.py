"""Run folders for training: starting a run (after every check passed) and resuming one.

The order in :func:`start_run` is the promise to the user: every option and every input is
checked, the data is read and tokenised and the model is built before the first file is written;
then the run folder appears whole (config, tokenizer and the step-0 checkpoint) or not at all, and
``--overwrite`` replaces an existing run folder only at that moment, and only a qkv run folder.

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
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from functools import partial
from pathlib import Path

import torch

from qkv.data.sources import (
    check_spec,
    data_fingerprint,
    open_training_data,
)
from qkv.data.spec import DataSpec
from qkv.data.text import TEXT_SOURCES
from qkv.data.tokenizer import Tokenizer
from qkv.models.options import check_trainable
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs import folder as run_folder
from qkv.runs.curves import plot_metrics
from qkv.runs.language_model import open_lm_task, start_lm_run
from qkv.runs.recipes import Recipe, decode_settings
from qkv.runs.recipes.choice import RecipeChoice, choose_recipe
from qkv.runs.translation_data import RUN_DATA_FOLDER, open_translation_task, write_run_data
from qkv.runtime import precision
from qkv.runtime.device import pick_device
from qkv.training import Distributed, TrainConfig, Trainer, TrainingCrashed, TranslationTask
from qkv.training.checkpoint_files import CHECKPOINT_FILE
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


def start_run(
    run_dir: str | Path,
    *,
    data: DataSpec,
    model_options: dict | None = None,
    train_options: dict | None = None,
    vocab_size: int | None = None,
    lm_options: dict | None = None,
    overwrite: bool = False,
    device: str | torch.device | None = None,
    dist: Distributed | None = None,
    decode: dict | None = None,
    recipe: str | Path | Recipe | None = None,
) -> Trainer:
    """Check everything, read the data, learn the tokenizer, build the model, and only then create
    the run folder (with its step-0 checkpoint, so it can be resumed from the first moment):
    :func:`start_translation_run`, or :func:`~qkv.runs.language_model.start_lm_run` for a language
    model's text. Returns a ready :class:`Trainer`.

    With several processes (``dist``), rank 0 creates the run folder as one process would, then
    every process opens it as :func:`resume_run` does, so all start from the same weights; an
    error on rank 0 is raised on every process.

    Args:
        run_dir: the run folder to create.
        data: where the sentences come from (:class:`~qkv.data.spec.DataSpec`), e.g.
            ``DataSpec(source="multi30k", src_lang="en", tgt_lang="de")``, ``DataSpec(source="prepared",
            folder=path)``, or for a language model ``DataSpec(source="text", train_text=path)``.
        model_options: :class:`TransformerConfig` fields (a language model's:
            :class:`~qkv.models.causal_lm.CausalLMConfig` fields) over the source's recipe (vocabulary
            sizes and ``pad_id`` come from the tokenizer).
        train_options: :class:`TrainConfig` fields over the recipe.
        vocab_size: BPE vocabulary size (default: the recipe's); a prepared folder's tokenizer is
            its own (a different ``vocab_size`` is reported, not applied).
        lm_options: a language model's ``tokenizer`` (``char`` or ``bpe``) and ``windows``
            (``random`` or ``strided``).
        overwrite: replace ``run_dir`` if it is a qkv run folder (or empty); anything else is refused.
        device: where the model trains (default: CUDA when present, else CPU).
        dist: this process's place among several (default: alone).
        decode: a translation run's ``beam_size`` and ``alpha`` for evaluation (default: the
            recipe's ``decode``, else :data:`qkv.runs.recipes.DEFAULT_DECODE`), kept in config.json.
        recipe: the recipe the options go over: a name (``qkv recipes`` lists them), a ``.toml`` file
            or a :class:`~qkv.runs.recipes.Recipe` (default: the data's, e.g. ``multi30k``, and on a
            CUDA device its ``gpu_variant``, e.g. ``multi30k-gpu``: :func:`~qkv.runs.recipes.choice.choose_recipe`).
            Its ``tokens_per_step``, if any, is split over ``dist``'s processes.

    Raises:
        ValueError / FileNotFoundError: a bad option or input, before anything is written.
    """
    if not isinstance(data, DataSpec):
        raise TypeError(f"data must be a DataSpec (DataSpec.from_json reads a config.json 'data'), got {data!r}")
    if data.source in TEXT_SOURCES:
        if data.both_directions:
            raise ValueError(
                "--both-directions is for translation from text (--data multi30k/dates or "
                "--train-src/--train-tgt), not a language model"
            )
        start = partial(start_lm_run, lm_options=lm_options)
    elif lm_options:
        raise ValueError(
            f"{', '.join(sorted(lm_options))}: options of a language model (--data tinyshakespeare or --train-text)"
        )
    else:
        start = partial(start_translation_run, decode=decode)
    choice = choose_recipe(
        recipe, data.source, dist.device if dist is not None and dist.enabled else pick_device(device)
    )
    given = train_options or {}
    world = dist.world_size if dist is not None and dist.enabled else 1
    steps = choice.recipe.step_options(world, max_tokens=given.get("max_tokens"), accum_steps=given.get("accum_steps"))
    train_options = {**steps, **given}
    start = partial(start, Path(run_dir), data=data, model_options=model_options, train_options=train_options)
    start = partial(start, choice=choice)
    start = partial(start, vocab_size=vocab_size, overwrite=overwrite)
    if dist is None or not dist.enabled:
        return start(device=device)
    _start_on_rank_0(start, dist)
    return resume_run(run_dir, device=device, dist=dist)


def _start_on_rank_0(start: Callable[..., Trainer], dist: Distributed) -> None:
    """Start a run on rank 0 alone, on the CPU (the others then open its folder); rank 0's error,
    if any, is raised on every process."""
    failure = None
    if dist.is_main:
        try:
            start(device="cpu")
        except (ValueError, OSError) as err:
            failure = (type(err).__name__, str(err))
    failure = dist.broadcast(failure)
    if failure is not None:
        kind = FileNotFoundError if failure[0] == "FileNotFoundError" else ValueError
        raise kind(failure[1])


def start_translation_run(
    run_dir: Path,
    *,
    data: DataSpec,
    model_options: dict | None,
    train_options: dict | None,
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
    train_config = TrainConfig.from_dict({**recipe.train, **(train_options or {})})
    train_config.check_stops()

    training = open_training_data(data, vocab_size=vocab_size, split_digits=recipe.split_digits)
    tokenizer = training.tokenizer
    model_config, train_config = _model_and_train_configs(
        choice, model_options, train_options, train_config, device, tokenizer
    )
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
        "decode": decode_settings({"decode": recipe.decode}) | (decode or {}),
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


def _model_and_train_configs(
    choice: RecipeChoice,
    model_options: dict | None,
    train_options: dict | None,
    train_config: TrainConfig,
    device: torch.device,
    tokenizer: Tokenizer,
) -> tuple[TransformerConfig, TrainConfig]:
    """The model and training configs on ``device``: the recipe's, the explicit options over them, in
    bf16 where the recipe asks for it and it is fast there (or where asked explicitly); the recipe,
    why it was chosen and the precision are logged (the same recipe on every machine: a faster
    variant is only suggested)."""
    asked_bf16 = "bf16" in (train_options or {})
    train_config = replace(train_config, bf16=precision.bf16_where_fast(train_config.bf16, device, asked=asked_bf16))
    for line in choice.start_notes(bf16=train_config.bf16, bf16_fast=precision.bf16_is_fast(device)):
        logger.info(line)
    model_config = _model_config(choice.recipe, model_options, tokenizer.vocab_size, tokenizer.pad_id)
    return model_config, train_config


def resume_run(
    run_dir: str | Path,
    *,
    train_options: dict | None = None,
    device: str | torch.device | None = None,
    dist: Distributed | None = None,
    trust_checkpoint: bool = False,
) -> Trainer:
    """Reopen a run folder where it stopped (weights, optimizer, data position, RNG).

    Args:
        run_dir: a folder made by :func:`start_run`.
        train_options: :class:`TrainConfig` fields to change, e.g. a longer ``max_minutes``
            (saved back into config.json once everything has been checked).
        device: where the model trains.
        dist: this process's place among several (default: alone); the run may have been saved
            by another number of processes.
        trust_checkpoint: load a ``state.pt`` holding pickled objects (an older qkv's) in full, once,
            and rewrite it safely (see :func:`qkv.training.checkpoint_files.load_checkpoint`); never for a run from others.

    Raises:
        ValueError / FileNotFoundError: not a run, a damaged checkpoint, bad options, or training
            data that changed since the run started.
    """
    run_dir = Path(run_dir)
    if dist is not None and dist.enabled:
        device = dist.device
    config = run_folder.read_run_config(run_dir)
    if not (run_dir / CHECKPOINT_FILE).is_file():
        raise FileNotFoundError(f"{run_dir / CHECKPOINT_FILE}: no training state to resume from")
    device = pick_device(device)
    try:
        train_config = TrainConfig.from_dict({**config.get("train", {}), **(train_options or {})})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{run_dir / 'config.json'}: {err}") from None
    model_config = run_folder.read_model_config(run_dir, config)
    train_config.check_stops()
    # the model is built only once config.json agrees with the weights saved with state.pt
    model = run_folder.build_run_model(run_dir, model_config, run_dir / "last.safetensors").to(device)
    if run_folder.run_task(config) == "lm":
        trainer = Trainer(model, open_lm_task(run_dir, config), train_config, run_dir, dist=dist)
        return _resumed(trainer, run_dir, config, train_config, train_options, trust_checkpoint)
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    assert isinstance(model_config, TransformerConfig)  # read_model_config: a translation run's
    task = open_translation_task(run_dir, config, tokenizer, model_config)
    trainer = Trainer(model, task, train_config, run_dir, dist=dist)
    return _resumed(trainer, run_dir, config, train_config, train_options, trust_checkpoint)


def _resumed(
    trainer: Trainer,
    run_dir: Path,
    config: dict,
    train_config: TrainConfig,
    train_options: dict | None,
    trust_checkpoint: bool = False,
) -> Trainer:
    trainer.resume(trust=trust_checkpoint)
    if train_options and asdict(train_config) != config.get("train") and trainer.dist.is_main:
        run_folder.write_config(run_dir, {**config, "train": asdict(train_config)})
    return trainer


def run_training(trainer: Trainer) -> Path:
    """Train until a stop condition, then write ``model.safetensors`` (averaged checkpoints) and
    ``curves.png``. On Ctrl-C the trainer saves a resumable checkpoint and ``KeyboardInterrupt``
    propagates; a failed step saves the last whole step and raises :class:`TrainingCrashed`.
    Returns the path of ``model.safetensors``."""
    try:
        trainer.train()
    finally:
        metrics, run_dir = trainer.metrics_path, trainer.run_dir
        if trainer.dist.is_main and metrics is not None and run_dir is not None and metrics.is_file():
            try:
                plot_metrics(metrics, run_dir / "curves.png")
            except Exception as err:  # noqa: BLE001 - a plot must never hide the training's own outcome
                logger.warning("could not draw curves.png (%s)", err)
    return trainer.finish()


__all__ = ["TrainingCrashed", "data_fingerprint", "resume_run", "run_training", "start_run"]
