"""Language-model run folders (task "lm"): starting one from a text, and opening its model and
task again. :func:`qkv.runs.start_run` and :func:`qkv.runs.resume_run` hand language-model data to
these; the promise is the same as for translation runs (everything checked before the folder appears,
whole or not at all)."""

from __future__ import annotations

import logging
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import torch

from qkv import checkpoint as ckpt, precision
from qkv.causal_lm import CausalLM, CausalLMConfig
from qkv.data.text import (TOKENIZER_KINDS, check_text_spec, load_text_splits, load_text_tokenizer, read_tokens,
                           train_text_tokenizer, write_tokens)
from qkv.device import pick_device
from qkv.recipes import RECIPES
from qkv.training import LanguageModelTask, TrainConfig, Trainer

logger = logging.getLogger(__name__)


def lm_model_config(recipe: dict, model_options: dict | None, vocab_size: int) -> CausalLMConfig:
    known = {f.name for f in fields(CausalLMConfig)}
    unknown = sorted(set(model_options or {}) - known)
    if unknown:
        raise ValueError(f"unknown language-model options: {unknown}")
    return CausalLMConfig(**{**recipe["model"], **(model_options or {}), "vocab_size": vocab_size})


def open_lm_task(run_dir: Path, config: dict) -> LanguageModelTask:
    """The task of a language-model run, from the token arrays it keeps (memory-mapped)."""
    vocab = config["model"]["vocab_size"]
    lm = config.get("lm", {})
    return LanguageModelTask(load_text_tokenizer(run_dir / "tokenizer.json"),
                             read_tokens(run_dir / "train.bin", vocab), read_tokens(run_dir / "val.bin", vocab),
                             context=config["model"]["context"], windows=lm.get("windows", "random"),
                             chars_per_token=lm.get("chars_per_token", 1.0))


def start_lm_run(run_dir: Path, *, data: dict, model_options: dict | None, train_options: dict | None,
                 vocab_size: int | None, lm_options: dict | None, overwrite: bool,
                 device: str | torch.device | None) -> Trainer:
    """:func:`qkv.runs.start_run` for a language model: the text is tokenised once into ``train.bin`` and
    ``val.bin`` in the run folder, which resuming and validation read (memory-mapped)."""
    check_text_spec(data)
    recipe = RECIPES[data["source"]]
    device = pick_device(device)
    inputs = [data.get(k) for k in ("train_text", "val_text") if data.get(k)]
    ckpt.check_new_run_dir(run_dir, overwrite=overwrite, inputs=inputs)
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

    train_text, valid_text, where = load_text_splits(data)
    # a character vocabulary covers the validation text too: a character seen only there is still predicted
    tokenizer = train_text_tokenizer(lm["tokenizer"], train_text + valid_text if lm["tokenizer"] == "char"
                                     else train_text, vocab_size)
    train_ids = np.asarray(tokenizer.encode(train_text), dtype=np.int64)
    valid_ids = np.asarray(tokenizer.encode(valid_text), dtype=np.int64)
    model_config = lm_model_config(recipe, model_options, tokenizer.vocab_size)
    lm["chars_per_token"] = round(len(valid_text) / max(1, len(valid_ids)), 6)
    task = LanguageModelTask(tokenizer, train_ids, valid_ids, context=model_config.context, windows=lm["windows"],
                             chars_per_token=lm["chars_per_token"])  # checks both splits hold a window
    # the precision once the data is known to be usable: a refused text's error is all the user reads
    asked_bf16 = "bf16" in (train_options or {})
    train_config = replace(train_config, bf16=precision.bf16_where_fast(train_config.bf16, device, asked=asked_bf16))
    logger.info("data: %s, %d training and %d validation tokens (%s tokenizer, %d ids)", where, len(train_ids),
                len(valid_ids), lm["tokenizer"], tokenizer.vocab_size)
    trainer = Trainer(CausalLM(model_config).to(device), task, train_config, run_dir)
    config = {"task": "lm", "model": asdict(model_config), "train": asdict(train_config), "data": data, "lm": lm}

    def write_initial(folder: Path) -> None:
        write_tokens(folder / "train.bin", train_ids, tokenizer.vocab_size)
        write_tokens(folder / "val.bin", valid_ids, tokenizer.vocab_size)
        trainer.save(folder)

    ckpt.create_run(run_dir, config, tokenizer, overwrite=overwrite, write_initial=write_initial, inputs=inputs)
    logger.info("model: %.2fM parameters; run folder %s", sum(p.numel() for p in trainer.model.parameters()) / 1e6,
                run_dir)
    return trainer
