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

This module creates and replaces run folders; opening one to decode is :mod:`qkv.inference.runs`
(below the trainer), whose names are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.inference.runs import (  # the loading half, re-exported: qkv 1.x defined them here
    RUN_MARKER,
    OpenRun,
    build_run_model,
    is_run_folder,
    load_run,
    load_translator,
    open_run,
    read_model_config,
    read_run_config,
    run_task,
)
from qkv.models.weights import RUN_FORMAT
from qkv.runtime.fileio import TMP_SUFFIX, atomic_folder, write_json

logger = logging.getLogger(__name__)

__all__ = [
    "RUN_ENTRIES",
    "RUN_FORMAT",
    "RUN_MARKER",
    "OpenRun",
    "build_run_model",
    "check_new_run_dir",
    "check_replaceable",
    "create_run",
    "foreign_entries",
    "is_run_folder",
    "load_run",
    "load_translator",
    "open_run",
    "read_model_config",
    "read_run_config",
    "run_task",
    "write_config",
]


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
