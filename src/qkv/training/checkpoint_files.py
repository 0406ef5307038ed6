"""The resumable checkpoint (``state.pt``): written atomically (:mod:`qkv.runtime.fileio`) and read
without running code (``weights_only``).

The weight files (safetensors) are :mod:`qkv.models.weights`, below the trainer so that what only
decodes reads them without importing it; their names are re-exported here. What a run folder holds,
and how a folder is recognised and loaded: :mod:`qkv.runs.folder` and :mod:`qkv.inference.runs`.
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from qkv.models.weights import (
    RUN_FORMAT,
    average_weight_files,
    check_saved_weights,
    load_weights,
    read_weights,
    save_weights,
)
from qkv.runtime.fileio import atomic_path, remove_stale_temporaries
from qkv.runtime.safe_load import check_zip_members, plain_values, refused_global
from qkv.runtime.textinput import check_input_file

logger = logging.getLogger(__name__)

__all__ = [  # the weight-file names are re-exported: they were defined here until qkv 2.0
    "CHECKPOINT_FILE",
    "RUN_FORMAT",
    "average_weight_files",
    "check_saved_weights",
    "load_checkpoint",
    "load_weights",
    "read_weights",
    "rng_state",
    "save_checkpoint",
    "save_weights",
    "saved_step",
    "set_rng_state",
]


CHECKPOINT_FILE = "state.pt"


def rng_state() -> dict:
    """This process's random state (CPU, and every CUDA device), as the checkpoint keeps it."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, model: torch.nn.Module, state: dict, *, weights: dict | None = None) -> None:
    """Write the resumable checkpoint: ``state.pt`` (the weights, default ``model.state_dict()``,
    plus ``state``: optimizer, position, RNG) as one atomic file, then ``last.safetensors`` from
    ``model`` for translating."""
    run_dir = Path(run_dir)
    step = int(state["train_state"]["step"])
    weights = model.state_dict() if weights is None else weights
    with atomic_path(run_dir / CHECKPOINT_FILE) as tmp:
        torch.save({**state, "format": RUN_FORMAT, "step": step, "model": weights}, tmp)
    save_weights(model, run_dir / "last.safetensors", step=step)


def load_checkpoint(run_dir: str | Path, *, clean: bool = True, trust: bool = False) -> dict:
    """Read ``state.pt``: ``{"model": weights (absent in runs written before format 2), "optimizer",
    "train_state", "rng", ...}``. With ``clean``, stale temporary files of a killed writer are
    removed first (only the one process that writes may do that).

    The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and
    containers, never a pickled object, whose loading could run any code (qkv writes nothing else).
    A file holding such objects is refused, unless ``trust`` (``qkv train --resume
    --trust-checkpoint``, for a run the user made with an older qkv): it is then loaded in full
    once and rewritten in the safe form, or refused if even that form cannot hold it.

    Runs written before format 2 kept the weights only in ``last.safetensors``; for those its step
    must equal the state's, else the run is refused.
    """
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_FILE
    try:
        check_input_file(path, "training state file")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no training state to resume from") from None
    if clean:
        for stale in remove_stale_temporaries(run_dir):
            logger.info("removed %s, left by an interrupted write", stale)
    check_zip_members(path)
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        if not trust:
            raise ValueError(
                f"{path}: holds pickled Python objects ({refused_global(err)}), which qkv never loads: "
                "loading them could run any code. If you made this run yourself with an older qkv, "
                "resume once with --trust-checkpoint to convert it"
            ) from None
        saved = _convert_trusted_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    _check_state_layout(saved, path)
    if "model" not in saved:
        weights = run_dir / "last.safetensors"
        with safe_open(str(weights), framework="pt") as handle:
            step = (handle.metadata() or {}).get("step")
        if step is not None and int(step) != saved["train_state"]["step"]:
            raise ValueError(f"{weights} holds step {step} but {path} step {saved['train_state']['step']}")
    return saved


def saved_step(run_dir: str | Path) -> int | None:
    """The step the run folder's ``state.pt`` holds, read back from the file (None if it cannot be
    read): what a message after a failed save reports, rather than the step it meant to save."""
    try:
        saved = torch.load(Path(run_dir) / CHECKPOINT_FILE, weights_only=True, map_location="cpu", mmap=True)
        return int(saved["train_state"]["step"])  # mapped: the weights are not read to learn one number
    except Exception:  # noqa: BLE001 - missing, damaged or foreign: nothing to report
        return None


def _convert_trusted_checkpoint(path: Path) -> dict:
    """Load a ``state.pt`` the user vouched for in full, and rewrite it in the form the safe loader
    reads (refused if that form cannot hold what it contains)."""
    try:
        saved = torch.load(path, weights_only=False, map_location="cpu")  # the user asked: --trust-checkpoint
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    saved = plain_values(saved)
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: holds a {type(saved).__name__}, not a training state; the run cannot be resumed")
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path}: holds objects qkv never writes ({refused_global(err)}); it cannot be converted to the safe form"
        ) from None
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())
    logger.warning("%s: converted to the safe checkpoint form (--trust-checkpoint); later resumes need no flag", path)
    return saved


def _check_state_layout(saved: object, path: Path) -> None:
    """The keys and types resuming relies on, so a foreign file is one line, not a traceback later."""
    if not isinstance(saved, dict) or not isinstance(saved.get("train_state"), dict) or "optimizer" not in saved:
        raise ValueError(f"{path}: not a qkv training state")
    step = saved["train_state"].get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: train_state.step is {step!r}, not a step count")
    weights = saved.get("model")
    if weights is not None and not (
        isinstance(weights, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())
    ):
        raise ValueError(f"{path}: its model weights are not a mapping of names to tensors")
