"""The checks every model config shares (:func:`check_model_options`), for
:class:`~qkv.models.transformer.TransformerConfig` and :class:`~qkv.models.causal_lm.CausalLMConfig`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

import torch

from qkv.nn.layers import ACTIVATIONS
from qkv.nn.positional import POSITIONAL_KINDS
from qkv.runtime.limits import MAX_FF_WIDTH, MAX_LAYERS, MAX_LENGTH, MAX_VOCAB_SIZE, MAX_WIDTH

# The largest sizes a model config takes live in qkv.runtime.limits (the data layer bounds its
# vocabulary with them too); MAX_SIZES maps each sized field of both model configs to its bound.
MAX_SIZES = {
    "src_vocab_size": MAX_VOCAB_SIZE,
    "tgt_vocab_size": MAX_VOCAB_SIZE,
    "vocab_size": MAX_VOCAB_SIZE,
    "num_encoder_layers": MAX_LAYERS,
    "num_decoder_layers": MAX_LAYERS,
    "num_layers": MAX_LAYERS,
    "d_model": MAX_WIDTH,
    "num_heads": MAX_WIDTH,
    "d_ff": MAX_FF_WIDTH,
    "max_len": MAX_LENGTH,
    "context": MAX_LENGTH,
}


def check_model_options(config: Any, positive: tuple[str, ...], positional: tuple[str, ...] = POSITIONAL_KINDS) -> None:
    """The checks every model config shares (``ValueError`` naming the field): the ``positive``
    integer fields (each at most its :data:`MAX_SIZES` bound), heads dividing ``d_model``, dropouts
    in [0, 1), ``layer_norm_eps``, the activation and the positional encoding (one of ``positional``)."""
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if name in MAX_SIZES and value > MAX_SIZES[name]:
            raise ValueError(f"{name} must be at most {MAX_SIZES[name]:,}, got {value:,}")
    if config.d_model % config.num_heads != 0:
        raise ValueError(f"d_model ({config.d_model}) must be divisible by num_heads ({config.num_heads})")
    for item in fields(config):  # types as declared: a bool is not a number, "false" not a bool
        value, kind = getattr(config, item.name), str(item.type)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (
            (kind == "bool" and not isinstance(value, bool))
            or (kind == "float" and not number)
            or (kind == "int" and not (number and isinstance(value, int)))
            or (kind == "str" and not isinstance(value, str))
        ):
            raise ValueError(f"{item.name} must be a {kind}, got {value!r}")
    for name in ("dropout", "attention_dropout"):
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:  # also rejects NaN
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if not 0 < config.layer_norm_eps < 1:  # also rejects NaN and infinity
        raise ValueError(f"layer_norm_eps must be positive, got {config.layer_norm_eps!r}")
    if config.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {config.activation!r}; choose one of {sorted(ACTIVATIONS)}")
    if config.positional not in positional:
        raise ValueError(f"unknown positional encoding {config.positional!r}; choose one of {positional}")
    if config.positional == "sinusoidal" and config.d_model % 2:
        raise ValueError(f"the sinusoidal encoding needs an even d_model, got {config.d_model}")


def changed_from_default(config: Any, names: Iterable[str]) -> list[str]:
    """The fields among ``names`` whose value in ``config`` is not the field's default, as
    ``name=value`` (what an exporter without those options names when it refuses).

    Args:
        config: a model config dataclass.
        names: field names (e.g. its ``OPTIONAL_FIELDS``, the options qkv 2.0 added).

    Returns:
        ``["num_kv_heads=2", ...]`` in field order.
    """
    wanted = set(names)
    return [
        f"{item.name}={getattr(config, item.name)!r}"
        for item in fields(config)
        if item.name in wanted and getattr(config, item.name) != item.default
    ]


def memory_bytes(device: torch.device | str | None = None) -> int | None:
    """The memory of ``device`` in bytes: a CUDA device's total memory, else the machine's physical
    memory (None where it cannot be read, or for the meta device, which holds nothing).

    Args:
        device: where the tensors go (None: the CPU).

    Returns:
        The total memory in bytes, or None.
    """
    where = torch.device("cpu" if device is None else device)
    if where.type == "meta":
        return None
    if where.type == "cuda":
        return int(torch.cuda.get_device_properties(where).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a system without these names (Windows)
        return None


def check_fits(parameters: int, bytes_per_parameter: int, what: str, device: torch.device | str | None) -> None:
    """Refuse, before anything is allocated, a model whose ``parameters`` need more memory than
    ``device`` has (``ValueError`` saying how much).

    Args:
        parameters: the model's parameter count (and its positional table's values).
        bytes_per_parameter: bytes each needs: 4 for float32 weights; 16 for training with Adam
            (weights, gradients and the two moments).
        what: what the memory is for, e.g. "its float32 weights".
        device: where it would be held (None: the CPU).
    """
    where = torch.device("cpu" if device is None else device)
    if where.type == "meta":  # holds nothing
        return
    needed, available = parameters * bytes_per_parameter, memory_bytes(where)
    if available is not None and needed > available:
        raise ValueError(
            f"a model of {parameters:,} parameters needs {needed / 2**30:,.1f} GiB for {what}, more than the "
            f"{available / 2**30:,.1f} GiB the {where.type} device "
            "has: choose smaller sizes (d_model, d_ff, layers, vocabulary, max_len/context)"
        )


def check_fits_weights(parameters: int) -> None:
    """:func:`check_fits` for a model about to be built with torch's default dtype and device (a
    model built on the meta device holds nothing and passes).

    Args:
        parameters: the model's :meth:`matrix_parameters`-style count.
    """
    dtype = torch.get_default_dtype()
    check_fits(
        parameters, dtype.itemsize, f"its {str(dtype).removeprefix('torch.')} weights", torch.get_default_device()
    )


#: bytes each parameter holds in training: float32 weights, their gradients and Adam's two moments
TRAINING_BYTES = 16


def check_trainable(parameters: int, device: torch.device | str | None, strategy: str = "ddp") -> None:
    """:func:`check_fits` for training a model of ``parameters`` on ``device``, called before the
    model is built or its run folder written (activations come on top: this refuses only what
    cannot fit at all).

    Args:
        parameters: the model's ``matrix_parameters()``.
        device: where it trains.
        strategy: TrainConfig's ``strategy``; fsdp shards the state over the processes, so each
            holds a share and the whole is not checked.
    """
    if strategy != "fsdp":
        check_fits(parameters, TRAINING_BYTES, "training (float32 weights, gradients and Adam's two moments)", device)
