"""The checks every model config shares (:func:`check_model_options`), for
:class:`~qkv.models.transformer.TransformerConfig` and :class:`~qkv.models.causal_lm.CausalLMConfig`."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from qkv.nn.layers import ACTIVATIONS
from qkv.nn.positional import POSITIONAL_KINDS


def check_model_options(config: Any, positive: tuple[str, ...]) -> None:
    """The checks every model config shares (``ValueError`` naming the field): the ``positive``
    integer fields, heads dividing ``d_model``, dropouts in [0, 1), ``layer_norm_eps``, the
    activation and the positional encoding."""
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
    if config.positional not in POSITIONAL_KINDS:
        raise ValueError(f"unknown positional encoding {config.positional!r}; choose one of {POSITIONAL_KINDS}")
    if config.positional == "sinusoidal" and config.d_model % 2:
        raise ValueError(f"the sinusoidal encoding needs an even d_model, got {config.d_model}")
