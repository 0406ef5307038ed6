"""The run lifecycle, one for every run kind: starting a run (after every check passed), resuming
one and finishing it. What differs per kind is the kind's (:mod:`qkv.runs.kinds`).

The order in :func:`start_run` is the promise to the user: every option and every input is
checked, the data is read and tokenised and the model is built before the first file is written;
then the run folder appears whole (config, tokenizer and the step-0 checkpoint) or not at all, and
``--overwrite`` replaces an existing run folder only at that moment, and only a qkv run folder.

"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from qkv.data.spec import DataSpec
from qkv.inference.kinds import SEQ2SEQ
from qkv.runs import folder as run_folder
from qkv.runs.curves import plot_metrics
from qkv.runs.kinds import kind_for_source, run_kind
from qkv.runs.recipes import Recipe
from qkv.runs.recipes.choice import choose_recipe
from qkv.runs.resolve import ResolvedOptions, resolve_run_options
from qkv.runtime.device import pick_device
from qkv.training import Distributed, TrainConfig, Trainer
from qkv.training.checkpoint_files import CHECKPOINT_FILE

logger = logging.getLogger(__name__)


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
    'the start hook of the data's run kind (:func:`~qkv.runs.kinds.kind_for_source`:
    :func:`~qkv.runs.translation_kind.start_translation_run`, or
    :func:`~qkv.runs.language_model.start_lm_run` for a language model's text). Returns a ready :class:`Trainer`.

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
    kind = kind_for_source(data.source)
    if data.both_directions and kind.model is not SEQ2SEQ:  # pairs read both ways: an encoder-decoder's
        raise ValueError(
            "--both-directions is for translation from text (--data multi30k/dates or "
            f"--train-src/--train-tgt), not a {kind.title}"
        )
    kind_options = kind.start_options(data, {"lm_options": lm_options, "decode": decode})
    device_here = dist.device if dist is not None and dist.enabled else pick_device(device)
    choice = choose_recipe(recipe, data.source, device_here)
    resolved = _resolved(choice.recipe, train_options, dist, device_here)

    def start(on: str | torch.device | None) -> Trainer:
        return kind.start(
            Path(run_dir),
            data=data,
            model_options=model_options,
            train_options=resolved,
            choice=choice,
            vocab_size=vocab_size,
            overwrite=overwrite,
            device=on,
            **kind_options,
        )

    if dist is None or not dist.enabled:
        return start(device)
    _start_on_rank_0(start, dist)
    return resume_run(run_dir, device=device, dist=dist)


def _resolved(
    recipe: Recipe, train_options: dict | None, dist: Distributed | None, device: str | torch.device
) -> ResolvedOptions:
    """The run's training options resolved once over ``recipe`` for its processes and ``device``
    (bf16 where it is fast there, decided by the resolve step alone); the run kind says them once
    its inputs are checked (a refused input's error is then all the user reads)."""
    world = dist.world_size if dist is not None and dist.enabled else 1
    return resolve_run_options(recipe, train_options, world_size=world, device=device)


def _start_on_rank_0(start: Callable[..., Trainer], dist: Distributed) -> None:
    """Start a run on rank 0 alone, on the CPU (the others then open its folder); rank 0's error,
    if any, is raised on every process."""
    failure = None
    if dist.is_main:
        try:
            start("cpu")
        except (ValueError, OSError) as err:
            failure = (type(err).__name__, str(err))
    failure = dist.broadcast(failure)
    if failure is not None:
        kind = FileNotFoundError if failure[0] == "FileNotFoundError" else ValueError
        raise kind(failure[1])


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
    task = run_kind(config).open_task(run_dir, config, model_config)
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


__all__ = ["resume_run", "run_training", "start_run"]
