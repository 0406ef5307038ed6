"""The language-model run kind's training hooks (task "lm"): starting a run from a text, and
opening its task again. :func:`qkv.runs.lifecycle.start_run` and :func:`qkv.runs.lifecycle.resume_run`
hand language-model data to these (through :data:`~qkv.runs.kinds.LANGUAGE_MODEL`, registered in
:mod:`qkv.runs.kinds`); the promise is the same as for translation runs (everything checked before
the folder appears, whole or not at all).

A run folder keeps its splits as token arrays (:mod:`qkv.data.text`): ``train.bin``, ``val.bin``
and, where the run has a test split, ``test.bin``, all written when the run starts. config.json's
``"lm"`` records, under ``"splits"``, each split's character range in its text, its token count
and characters per token (``"test": null`` for a run without a test split); a resume checks the
three files against those counts (by their size: ``test.bin`` is never opened by training). A run
folder made before test splits existed has no ``"splits"`` and no ``test.bin``; it resumes as
before, and :func:`missing_test_split` says why it has no test split.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.data.spec import DataSpec
from qkv.data.text import (
    TOKENIZER_KINDS,
    check_text_spec,
    load_text_tokenizer,
    open_text_training_data,
    read_tokens,
    token_dtype,
    write_tokens,
)
from qkv.inference.kinds import LM_SECTION
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.options import check_trainable
from qkv.runs import folder as run_folder
from qkv.runs.kinds import LANGUAGE_MODEL
from qkv.runs.recipes import Recipe
from qkv.runs.recipes.budget import SIZE_KEYS_SETTINGS, choose_size, measured_speeds, model_values, with_settings
from qkv.runs.recipes.choice import RecipeChoice
from qkv.runs.resolve import ResolvedOptions, as_resolved
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import default_cache_dir
from qkv.training import LanguageModelTask, TrainConfig, Trainer

logger = logging.getLogger(__name__)


def lm_model_config(recipe: Recipe, model_options: dict | None, vocab_size: int) -> CausalLMConfig:
    """The recipe's language model with the explicit options over it, for a vocabulary of ``vocab_size``."""
    known = {f.name for f in fields(CausalLMConfig)}
    unknown = sorted(set(model_options or {}) - known)
    if unknown:
        raise ValueError(f"unknown language-model options: {unknown}")
    return CausalLMConfig(**{**recipe.model, **(model_options or {}), "vocab_size": vocab_size})


SPLIT_FILES = {"train": "train.bin", "val": "val.bin", "test": "test.bin"}


def check_lm_arrays(run_dir: Path, config: dict, names: Iterable[str] = ("train", "val", "test")) -> None:
    """Check the token arrays of ``names`` in a run folder against the token counts config.json
    records (by each file's size, without opening it). A split the run lacks (a test split under
    ``--val-text`` alone, or any split of a run folder older than these records) is skipped here.
    Raises ``FileNotFoundError`` for a missing array, ``ValueError`` for one of another size."""
    splits = config.get(LM_SECTION, {}).get("splits")
    if not isinstance(splits, dict):
        return
    itemsize = np.dtype(token_dtype(config["model"]["vocab_size"])).itemsize
    for name in names:
        split = splits.get(name)
        if split is None:
            continue
        path = run_dir / SPLIT_FILES[name]
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: the run's {name} tokens are missing (config.json records "
                f"{split['tokens']}); the run folder is damaged"
            )
        size, expected = path.stat().st_size, split["tokens"] * itemsize
        if size != expected:
            raise ValueError(
                f"{path}: {size} bytes, but config.json records {split['tokens']} tokens ({expected} "
                "bytes); the run folder's token arrays changed since the run started"
            )


def missing_test_split(config: dict) -> str | None:
    """None when a language-model run has a test split, else a sentence saying why it has none."""
    splits = config.get(LM_SECTION, {}).get("splits")
    if not isinstance(splits, dict):
        return (
            "this run folder was made before qkv kept a test split (its validation split is the last 10% of the text)"
        )
    if splits.get("test") is None:
        return "this run has no test split (it was trained with --val-text and no --test-text)"
    return None


def open_lm_task(run_dir: Path, config: dict) -> LanguageModelTask:
    """The task of a language-model run, from the training and validation token arrays it keeps
    (memory-mapped); the test array is checked by its size only, never opened."""
    vocab = config["model"]["vocab_size"]
    lm = config.get(LM_SECTION, {})
    check_lm_arrays(run_dir, config)
    return LanguageModelTask(
        load_text_tokenizer(run_dir / "tokenizer.json"),
        read_tokens(run_dir / "train.bin", vocab),
        read_tokens(run_dir / "val.bin", vocab),
        context=config["model"]["context"],
        windows=lm.get("windows", "random"),
        chars_per_token=lm.get("chars_per_token", 1.0),
    )


def _run_config(
    model_config: CausalLMConfig, train_config: TrainConfig, data: DataSpec, choice: RecipeChoice, sizing: dict | None
) -> dict[str, Any]:
    """A language-model run's config.json, but for its ``lm`` section."""
    return {
        "task": LANGUAGE_MODEL.name,
        "model": asdict(model_config),
        "train": asdict(train_config),
        "data": data.to_json(),
        "recipe": {**choice.record(), **({"sizing": sizing} if sizing is not None else {})},
    }


def start_lm_run(
    run_dir: Path,
    *,
    data: DataSpec,
    model_options: dict | None,
    train_options: dict | ResolvedOptions | None,
    vocab_size: int | None,
    lm_options: dict | None,
    overwrite: bool,
    device: str | torch.device | None,
    choice: RecipeChoice,
) -> Trainer:
    """:func:`qkv.runs.lifecycle.start_run` for a language model: the text is cut into its splits
    (:func:`qkv.data.text.read_text_splits`) and tokenised once into ``train.bin``, ``val.bin`` and
    ``test.bin`` (where there is a test split) in the run folder. Training and resuming read the
    first two (memory-mapped); only ``qkv evaluate`` reads ``test.bin``."""
    check_text_spec(data)
    recipe = choice.recipe
    device = pick_device(device)
    run_folder.check_new_run_dir(run_dir, overwrite=overwrite, inputs=data.input_files())
    lm = _lm_settings(recipe, lm_options)
    vocab_size = _lm_vocab_size(recipe, lm["tokenizer"], vocab_size)
    lm_model_config(recipe, model_options, 1)  # the model options' own checks, before reading data
    resolved = as_resolved(recipe, train_options, device=device)
    train_config = resolved.train_config()  # bf16 as the resolve step decided it for this machine
    train_config.check_stops()

    text = open_text_training_data(data, tokenizer_kind=lm["tokenizer"], vocab_size=vocab_size)
    tokenizer, ids = text.tokenizer, text.ids
    device = torch.device(device)
    # the size is measured in the precision the run trains in (said once the data is known to be usable)
    model_options, train_config, sizing = _sized_by_budget(
        recipe, model_options, resolved.given, train_config, tokenizer, ids, lm["windows"], device
    )
    model_config = lm_model_config(recipe, model_options, tokenizer.vocab_size)
    check_trainable(model_config.matrix_parameters(), device, train_config.strategy)  # before building it
    valid_split = text.splits["val"]
    assert valid_split is not None  # every language model has a validation split
    lm.update(chars_per_token=valid_split["chars_per_token"], splits=text.splits)
    task = LanguageModelTask(  # checks both splits hold a window
        tokenizer,
        ids["train"],
        ids["val"],
        context=model_config.context,
        windows=lm["windows"],
        chars_per_token=lm["chars_per_token"],
    )
    _check_test_window(ids, model_config.context)
    # the options and the precision once the data is known to be usable: a refused text's error is
    # all the user reads
    resolved.say(logger)
    for line in choice.start_notes(bf16=train_config.bf16, bf16_fast=bool(resolved.bf16_fast)):
        logger.info(line)
    if sizing is not None:
        logger.info("model size: %s", sizing["why"])
        if "size" not in sizing:  # a size option given: nothing chosen to record
            sizing = None
    _log_data(text.where, ids, lm["tokenizer"], tokenizer.vocab_size)
    trainer = Trainer(CausalLM(model_config).to(device), task, train_config, run_dir)
    config = _run_config(model_config, train_config, data, choice, sizing)

    def write_initial(folder: Path) -> None:
        for name, array in ids.items():
            write_tokens(folder / SPLIT_FILES[name], array, tokenizer.vocab_size)
        trainer.save(folder)

    inputs = data.input_files()
    run_folder.create_run(
        run_dir, config | {LM_SECTION: lm}, tokenizer, overwrite=overwrite, write_initial=write_initial, inputs=inputs
    )
    logger.info(
        "model: %.2fM parameters; run folder %s", sum(p.numel() for p in trainer.model.parameters()) / 1e6, run_dir
    )
    return trainer


def _log_data(where: str, ids: dict[str, np.ndarray], tokenizer_kind: str, vocab_size: int) -> None:
    test_tokens = len(ids["test"]) if "test" in ids else "no"
    logger.info(
        "data: %s; %d training, %d validation and %s test tokens (%s tokenizer, %d ids)",
        where,
        len(ids["train"]),
        len(ids["val"]),
        test_tokens,
        tokenizer_kind,
        vocab_size,
    )


def _sized_by_budget(
    recipe: Recipe,
    model_options: dict | None,
    train_options: dict,
    train_config: TrainConfig,
    tokenizer: Any,
    ids: dict[str, np.ndarray],
    windows: str,
    device: torch.device,
) -> tuple[dict | None, TrainConfig, dict | None]:
    """The model options and training settings of a recipe with a ``[budget]`` rule
    (:mod:`qkv.runs.recipes.budget`): the size the budget affords, unless a size option
    (``--d-model``, ``--layers``, ``--context``, ``--max-tokens`` ...) is given, which turns the rule off.
    The speeds are measured in ``train_config``'s precision, the one the run trains in.
    Returns the options, the training settings and config.json's record of the choice (or None)."""
    if recipe.budget is None:
        return model_options, train_config, None
    rule = with_settings(recipe.budget, model_options or {})  # --dropout: every size's, still chosen
    size_keys = {key for size in rule.sizes for key in size} - set(SIZE_KEYS_SETTINGS)
    given = sorted(size_keys & ({**(model_options or {}), **(train_options or {})}).keys())
    if given:  # said once the data has passed its checks
        return model_options, train_config, {"why": f"as given ({', '.join(given)}), not chosen by the budget"}

    def task_for(context: int) -> LanguageModelTask:
        return LanguageModelTask(tokenizer, ids["train"], None, context=context, windows=windows)

    speed = measured_speeds(
        rule,
        recipe.model,
        task_for,
        vocab_size=tokenizer.vocab_size,
        device=device,
        bf16=train_config.bf16,
        cache_dir=default_cache_dir(),
        weight_decay=train_config.weight_decay,
        optimizer=train_config.optimizer,
    )
    c = train_config
    chosen = choose_size(
        rule,
        recipe.model,
        tokenizer.vocab_size,
        minutes=c.max_minutes,
        max_steps=c.max_steps,
        epochs=c.max_epochs,
        train_tokens=len(ids["train"]),
        speed=speed,
    )
    size = rule.sizes[chosen.index]
    if "max_tokens" in size:
        train_config = replace(train_config, max_tokens=size["max_tokens"])
    record = {"size": dict(size), "tokens": round(chosen.tokens), "parameters": chosen.parameters, "why": chosen.why}
    return {**(model_options or {}), **model_values(size)}, train_config, record


def _lm_settings(recipe: Recipe, lm_options: dict | None) -> dict[str, Any]:
    """The recipe's ``lm`` settings (``tokenizer``, ``windows``) under the options given, checked."""
    unknown = sorted(set(lm_options or {}) - set(recipe.lm))
    if unknown:
        raise ValueError(f"unknown language-model options: {unknown}")
    lm = {**recipe.lm, **{k: v for k, v in (lm_options or {}).items() if v is not None}}
    if lm["tokenizer"] not in TOKENIZER_KINDS:
        raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, got {lm['tokenizer']!r}")
    if lm["windows"] not in LanguageModelTask.WINDOWS:
        raise ValueError(f"--windows must be one of {', '.join(LanguageModelTask.WINDOWS)}, got {lm['windows']!r}")
    return lm


def _lm_vocab_size(recipe: Recipe, tokenizer_kind: str, vocab_size: int | None) -> int | None:
    """The BPE vocabulary (the recipe's unless given), checked; None for a character tokenizer."""
    if tokenizer_kind == "bpe":
        vocab_size = recipe.vocab_size if vocab_size is None else vocab_size
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 260:
            raise ValueError(f"--vocab-size must be an integer >= 260 (256 bytes + 4 specials), got {vocab_size!r}")
    elif vocab_size is not None:
        raise ValueError("--vocab-size is for --tokenizer bpe (a character vocabulary is the text's characters)")
    return vocab_size


def _check_test_window(ids: dict[str, np.ndarray], context: int) -> None:
    """A test split must hold one window of the model's context plus the token it predicts."""
    if "test" in ids and len(ids["test"]) < context + 1:
        raise ValueError(
            f"the test text has {len(ids['test'])} tokens, fewer than one window of the model's context "
            f"({context}) plus one: give more text or a smaller --context"
        )


def start_options(data: DataSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """A language model's own start option (``lm_options``); a translation run's ``decode`` is not
    one of its options and is left unused, as before.

    Args:
        data: the run's data.
        options: ``lm_options`` and ``decode`` as given to :func:`~qkv.runs.lifecycle.start_run`.

    Returns:
        The keywords for :func:`start_lm_run`.
    """
    return {"lm_options": options.get("lm_options")}


def open_task(run_dir: Path, config: dict, model_config: Any) -> LanguageModelTask:
    """The task of a language-model run being resumed (:func:`open_lm_task`).

    Args:
        run_dir: the run folder.
        config: its config.json, read.
        model_config: its model's config (the task reads the context from ``config``).

    Returns:
        The :class:`~qkv.training.LanguageModelTask`.
    """
    return open_lm_task(run_dir, config)
