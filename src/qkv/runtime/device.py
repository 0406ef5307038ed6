"""The one place qkv picks a device: ``None``/``"auto"`` means CUDA when present, else the CPU;
anything else is checked before any work starts, so ``--device cuda`` on a machine without CUDA
is a one-line error, not a traceback after a run folder was made."""

from __future__ import annotations

import torch


def pick_device(requested: str | torch.device | None = None) -> torch.device:
    """The device to run on.

    Args:
        requested: ``None`` or ``"auto"`` (CUDA when available, else CPU), or a torch device
            string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``.

    Raises:
        ValueError: the string is not a device, or names CUDA (or a CUDA index) that this machine
            does not have.
    """
    if requested is None or requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(requested)!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(requested)!r} was asked for, but CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(requested)!r}: this machine has {torch.cuda.device_count()} CUDA "
                f"device{'' if torch.cuda.device_count() == 1 else 's'}"
            )
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {str(requested)!r}; use cpu, cuda or cuda:N")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are."""
    return next(model.parameters()).device
