"""A model's weight files (safetensors): saving, loading after every check, reading, averaging.

What only decodes (``qkv translate``, ``qkv serve``, the exporters) reads weights through this module,
so it never imports the trainer; the trainer's resumable ``state.pt`` is
:mod:`qkv.training.checkpoint_files`, which re-exports these names. Every file is written atomically
(:mod:`qkv.runtime.fileio`) and read without running code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from qkv.runtime.fileio import atomic_path
from qkv.runtime.safe_load import TensorInfo, check_shapes, meta_shapes, weights_header

RUN_FORMAT = 2  # a run folder's format (config.json's "qkv_run"); 2: state.pt holds the weights too

__all__ = [
    "RUN_FORMAT",
    "average_weight_files",
    "check_saved_weights",
    "load_weights",
    "read_weights",
    "save_weights",
]


def save_weights(model: torch.nn.Module, path: str | Path, *, step: int | None = None) -> None:
    """Save ``model``'s weights as safetensors (tied tensors stored once), atomically.

    Args:
        model: the module whose ``state_dict`` is saved.
        path: the file to write.
        step: the training step, kept in the file's metadata.
    """
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=None if step is None else {"step": str(step)})


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load safetensors weights into ``model``; every tensor must match (names and shapes).

    Args:
        model: the module to fill (its own tensors are overwritten in place).
        path: a safetensors file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is damaged or does not fit the model (one line naming the first problem).
    """
    path = Path(path)
    expected, tied = meta_shapes(model)  # tied weights are stored once: any name of a tied group stands for it
    check_shapes(expected, weights_header(path), config_path="the model", weights_path=path, tied=tied)
    tensors = read_weights(path)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file.

    Args:
        path: the file.

    Returns:
        Its tensors by name.

    Raises:
        ValueError: the file is damaged (one line).
    """
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0][:200]})") from None


def average_weight_files(paths: list[Path], out_path: str | Path) -> None:
    """Average several safetensors files of one model (Vaswani et al. section 6.1 averages the last 5).

    Args:
        paths: the files, all of the same model.
        out_path: where the average is written (float32, atomically).

    Raises:
        ValueError: ``paths`` is empty.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        for name, tensor in load_file(str(p)).items():
            total[name] = total.get(name, 0) + tensor.double()
    averaged = {name: (t / len(paths)).float().contiguous() for name, t in total.items()}
    with atomic_path(out_path) as tmp:
        save_file(averaged, str(tmp), metadata={"format": "pt"})


def check_saved_weights(model: torch.nn.Module, weights: dict, path: str | Path) -> None:
    """The weights a checkpoint holds fit ``model`` (names and shapes).

    Args:
        model: the module they are meant for.
        weights: the tensors by name.
        path: the file they came from (named in the error).

    Raises:
        ValueError: one line naming the first mismatch.
    """
    expected, tied = meta_shapes(model)
    header = {
        name: TensorInfo(tuple(t.shape), "F32" if t.is_floating_point() else str(t.dtype))
        for name, t in weights.items()
    }
    check_shapes(expected, header, config_path="config.json", weights_path=path, tied=tied)
