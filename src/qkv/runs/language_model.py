"""Language-model run folders (task "lm"): starting one from a text, and opening its model and
task again. :func:`qkv.runs.translation.start_run` and :func:`qkv.runs.translation.resume_run` hand language-model data to
these; the promise is the same as for translation runs (everything checked before the folder appears,
whole or not at all).

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
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import torch

from qkv.runs import folder as run_folder
from qkv.runtime import precision
from qkv.training.checkpoint_files import CHECKPOINT_FILE
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.data.text import (TOKENIZER_KINDS, check_text_spec, load_text_tokenizer, read_text_splits, read_tokens,
                           token_dtype, train_text_tokenizer, write_tokens)
from qkv.runtime.device import pick_device
from qkv.runs.recipes import RECIPES
from qkv.training import LanguageModelTask, TrainConfig, Trainer

logger = logging.getLogger(__name__)


def lm_model_config(recipe: dict, model_options: dict | None, vocab_size: int) -> CausalLMConfig:
    known = {f.name for f in fields(CausalLMConfig)}
    unknown = sorted(set(model_options or {}) - known)
    if unknown:
        raise ValueError(f"unknown language-model options: {unknown}")
    return CausalLMConfig(**{**recipe["model"], **(model_options or {}), "vocab_size": vocab_size})


SPLIT_FILES = {"train": "train.bin", "val": "val.bin", "test": "test.bin"}


def check_lm_arrays(run_dir: Path, config: dict, names=("train", "val", "test")) -> None:
    """Check the token arrays of ``names`` in a run folder against the token counts config.json
    records (by each file's size, without opening it). A split the run lacks (a test split under
    ``--val-text`` alone, or any split of a run folder older than these records) is skipped here.
    Raises ``FileNotFoundError`` for a missing array, ``ValueError`` for one of another size."""
    splits = config.get("lm", {}).get("splits")
    if not isinstance(splits, dict):
        return
    itemsize = np.dtype(token_dtype(config["model"]["vocab_size"])).itemsize
    for name in names:
        split = splits.get(name)
        if split is None:
            continue
        path = run_dir / SPLIT_FILES[name]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the run's {name} tokens are missing (config.json records "
                                    f"{split['tokens']}); the run folder is damaged")
        size, expected = path.stat().st_size, split["tokens"] * itemsize
        if size != expected:
            raise ValueError(f"{path}: {size} bytes, but config.json records {split['tokens']} tokens ({expected} "
                             "bytes); the run folder's token arrays changed since the run started")


def missing_test_split(config: dict) -> str | None:
    """None when a language-model run has a test split, else a sentence saying why it has none."""
    splits = config.get("lm", {}).get("splits")
    if not isinstance(splits, dict):
        return ("this run folder was made before qkv kept a test split (its validation split is the last 10% of "
                "the text)")
    if splits.get("test") is None:
        return "this run has no test split (it was trained with --val-text and no --test-text)"
    return None


def open_lm_task(run_dir: Path, config: dict) -> LanguageModelTask:
    """The task of a language-model run, from the training and validation token arrays it keeps
    (memory-mapped); the test array is checked by its size only, never opened."""
    vocab = config["model"]["vocab_size"]
    lm = config.get("lm", {})
    check_lm_arrays(run_dir, config)
    return LanguageModelTask(load_text_tokenizer(run_dir / "tokenizer.json"),
                             read_tokens(run_dir / "train.bin", vocab), read_tokens(run_dir / "val.bin", vocab),
                             context=config["model"]["context"], windows=lm.get("windows", "random"),
                             chars_per_token=lm.get("chars_per_token", 1.0))


def start_lm_run(run_dir: Path, *, data: dict, model_options: dict | None, train_options: dict | None,
                 vocab_size: int | None, lm_options: dict | None, overwrite: bool,
                 device: str | torch.device | None) -> Trainer:
    """:func:`qkv.runs.translation.start_run` for a language model: the text is cut into its splits
    (:func:`qkv.data.text.read_text_splits`) and tokenised once into ``train.bin``, ``val.bin`` and
    ``test.bin`` (where there is a test split) in the run folder. Training and resuming read the
    first two (memory-mapped); only ``qkv evaluate`` reads ``test.bin``."""
    check_text_spec(data)
    recipe = RECIPES[data["source"]]
    device = pick_device(device)
    inputs = [data.get(k) for k in ("train_text", "val_text", "test_text") if data.get(k)]
    run_folder.check_new_run_dir(run_dir, overwrite=overwrite, inputs=inputs)
    unknown = sorted(set(lm_options or {}) - set(recipe["lm"]))
    if unknown:
        raise ValueError(f"unknown language-model options: {unknown}")
    lm = {**recipe["lm"], **{k: v for k, v in (lm_options or {}).items() if v is not None}}
    if lm["tokenizer"] not in TOKENIZER_KINDS:
        raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, got {lm['tokenizer']!r}")
    if lm["windows"] not in LanguageModelTask.WINDOWS:
        raise ValueError(f"--windows must be one of {', '.join(LanguageModelTask.WINDOWS)}, got {lm['windows']!r}")
    if lm["tokenizer"] == "bpe":
        vocab_size = recipe["vocab_size"] if vocab_size is None else vocab_size
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 260:
            raise ValueError(f"--vocab-size must be an integer >= 260 (256 bytes + 4 specials), got {vocab_size!r}")
    elif vocab_size is not None:
        raise ValueError("--vocab-size is for --tokenizer bpe (a character vocabulary is the text's characters)")
    lm_model_config(recipe, model_options, 1)  # the model options' own checks, before reading data
    train_config = TrainConfig.from_dict({**recipe["train"], **(train_options or {})})
    train_config.check_stops()

    texts = read_text_splits(data)
    # a character vocabulary covers the validation and test texts' characters too (the set of them, nothing
    # more): a character seen only there is still predicted, and can be encoded
    tokenizer = train_text_tokenizer(lm["tokenizer"], texts.train + texts.val + (texts.test or "")
                                     if lm["tokenizer"] == "char" else texts.train, vocab_size)
    ids = {name: np.asarray(tokenizer.encode(text), dtype=np.int64)
           for name, text in zip(("train", "val", "test"), texts[:3]) if text is not None}
    train_ids, valid_ids = ids["train"], ids["val"]
    model_config = lm_model_config(recipe, model_options, tokenizer.vocab_size)
    splits = {name: ({"chars": texts.chars[name], "tokens": len(ids[name]),
                      "chars_per_token": round(len(text) / max(1, len(ids[name])), 6)} if text is not None else None)
              for name, text in zip(("train", "val", "test"), texts[:3])}
    lm["chars_per_token"] = splits["val"]["chars_per_token"]
    lm["splits"] = splits
    task = LanguageModelTask(tokenizer, train_ids, valid_ids, context=model_config.context, windows=lm["windows"],
                             chars_per_token=lm["chars_per_token"])  # checks both splits hold a window
    if "test" in ids and len(ids["test"]) < model_config.context + 1:
        raise ValueError(f"the test text has {len(ids['test'])} tokens, fewer than one window of the model's context "
                         f"({model_config.context}) plus one: give more text or a smaller --context")
    # the precision once the data is known to be usable: a refused text's error is all the user reads
    asked_bf16 = "bf16" in (train_options or {})
    train_config = replace(train_config, bf16=precision.bf16_where_fast(train_config.bf16, device, asked=asked_bf16))
    logger.info("data: %s; %d training, %d validation and %s test tokens (%s tokenizer, %d ids)", texts.where,
                len(train_ids), len(valid_ids), len(ids["test"]) if "test" in ids else "no", lm["tokenizer"],
                tokenizer.vocab_size)
    trainer = Trainer(CausalLM(model_config).to(device), task, train_config, run_dir)
    config = {"task": "lm", "model": asdict(model_config), "train": asdict(train_config), "data": data, "lm": lm}

    def write_initial(folder: Path) -> None:
        for name, array in ids.items():
            write_tokens(folder / SPLIT_FILES[name], array, tokenizer.vocab_size)
        trainer.save(folder)

    run_folder.create_run(run_dir, config, tokenizer, overwrite=overwrite, write_initial=write_initial, inputs=inputs)
    logger.info("model: %.2fM parameters; run folder %s", sum(p.numel() for p in trainer.model.parameters()) / 1e6,
                run_dir)
    return trainer
