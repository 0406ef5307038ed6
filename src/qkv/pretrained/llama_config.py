"""The ``config.json`` of a Llama, Mistral or Qwen2 folder as a :class:`~qkv.CausalLMConfig`.

The three families share one layout (see :mod:`qkv.pretrained.llama`) and differ in a few options,
each mapped to a field of :class:`~qkv.CausalLMConfig` by :func:`llama_config`:

- Llama: rotary scaling (``linear``, ``llama3``) and optional biases (``attention_bias`` on the
  q/k/v/o projections, ``mlp_bias`` on the feed-forward);
- Mistral: a sliding window over the keys in every layer (``sliding_window``);
- Qwen2: biases on the q/k/v projections only, and a sliding window on the layers from
  ``max_window_layers`` on (or as transformers 5's ``layer_types`` lists them) when
  ``use_sliding_window``.

Rotary settings are read in both forms: transformers 5's ``rope_parameters`` and the older top-level
``rope_theta`` with ``rope_scaling``. A configuration without an exact counterpart in qkv (another
rotary type, a head width other than ``hidden_size // num_attention_heads``, quantised weights, ...)
is refused in one line naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qkv.models.causal_lm import CausalLMConfig

logger = logging.getLogger(__name__)

LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Each family's defaults for the fields its config class fills in when config.json leaves them out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, intermediate_size=11008, max_position_embeddings=2048, num_key_value_heads=None),
    "mistral": dict(
        vocab_size=32000, intermediate_size=14336, max_position_embeddings=4096 * 32, num_key_value_heads=8
    ),
    "qwen2": dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768, num_key_value_heads=32),
}
COMMON_DEFAULTS: dict[str, Any] = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6, hidden_act="silu"
)
# hidden_act -> the gated activation qkv computes as act(x W_gate) * (x W_1): transformers' MLP of
# these families is down(act(gate(x)) * up(x)), with ACT2FN's exact (erf) GELU for "gelu".
GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
ROPE_THETA = 10000.0  # transformers' default rotary base
LAYER_TYPES = ("full_attention", "sliding_attention")


def llama_config(data: Mapping[str, Any]) -> CausalLMConfig:
    """A :class:`~qkv.CausalLMConfig` from the ``config.json`` of a Llama, Mistral or Qwen2 folder.

    Args:
        data: the parsed ``config.json`` (``model_type`` one of :data:`LLAMA_MODEL_TYPES`); fields it
            leaves out take the family's defaults, as transformers' config classes do.

    Returns:
        The config: RMSNorm, rotary positions, a gated feed-forward, grouped-query heads, the window.

    Raises:
        ValueError: an option without an exact counterpart in qkv, or a bad value; one line naming
            the field.
    """
    family = data.get("model_type")
    if family not in LLAMA_MODEL_TYPES:
        raise ValueError(f"model_type={family!r} is not one of {', '.join(LLAMA_MODEL_TYPES)}")
    values = dict(COMMON_DEFAULTS, **FAMILY_DEFAULTS[family])
    values.update({k: data[k] for k in values if k in data})
    if data.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantised weights have no counterpart in qkv's float layers")
    activation = values["hidden_act"]
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"hidden_act={activation!r} has no exact counterpart in qkv (supported: {sorted(GATED_ACTIVATIONS)})"
        )
    d_model, num_heads = _int(values, "hidden_size"), _int(values, "num_attention_heads")
    if d_model % num_heads:
        raise ValueError(f"hidden_size={d_model} is not divisible by num_attention_heads={num_heads}")
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim != d_model // num_heads:
        raise ValueError(
            f"head_dim={head_dim} differs from hidden_size // num_attention_heads = {d_model // num_heads} "
            "(qkv's heads are d_model // num_heads wide)"
        )
    kv_heads = num_heads if values["num_key_value_heads"] is None else _int(values, "num_key_value_heads")
    if num_heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={num_heads}")
    num_layers = _int(values, "num_hidden_layers")
    context = _int(values, "max_position_embeddings")
    window, window_layers = _window_options(family, data, num_layers)
    qkv_bias, bias = _bias_options(family, data)
    attention_dropout = data.get("attention_dropout") or 0.0  # only training reads it
    return CausalLMConfig(
        vocab_size=_int(values, "vocab_size"),
        d_model=d_model,
        num_heads=num_heads,
        num_layers=num_layers,
        d_ff=_int(values, "intermediate_size"),
        context=context,
        dropout=0.0,
        attention_dropout=float(attention_dropout),
        activation=GATED_ACTIVATIONS[activation],
        norm_first=True,
        norm="rms",
        layer_norm_eps=float(values["rms_norm_eps"]),
        positional="rotary",
        scale_embedding=False,
        tie_output=data.get("tie_word_embeddings", False) is True,
        bias=bias,
        qkv_bias=qkv_bias,
        num_kv_heads=kv_heads,
        sliding_window=window,
        sliding_window_layers=window_layers,
        **_rope_options(data, context),
    )


def _int(values: Mapping[str, Any], name: str) -> int:
    value = values[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} is not a positive integer")
    return value


def _rope_options(data: Mapping[str, Any], context: int) -> dict[str, Any]:
    """The ``rotary_*`` fields from ``rope_parameters`` (transformers 5) or the older top-level
    ``rope_theta`` and ``rope_scaling``; transformers prefers ``rope_scaling`` when both are there."""
    key = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    params = data.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{key}={params!r} is not an object")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:  # one dict per layer type: qkv has one rotary setting for all layers
        if any(v != nested[0] for v in nested) or len(nested) != len(params):
            raise ValueError(f"{key}: a rotary setting per layer type has no counterpart in qkv")
        params = nested[0]
    kind_key = "rope_type" if "rope_type" in params else "type"  # transformers 4 also wrote "type"
    kind = params.get(kind_key, "default")
    theta = params.get("rope_theta", data.get("rope_theta", ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ValueError(f"{key}.rope_theta={theta!r} is not a number above 1")
    fraction = params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if fraction != 1.0:  # these families' modelling code rotates every dimension of a head
        raise ValueError(f"partial_rotary_factor={fraction!r}: Llama, Mistral and Qwen2 rotate whole heads")
    options: dict[str, Any] = dict(rotary_base=float(theta), rotary_fraction=1.0, rotary_scaling="none")
    if kind == "default":
        return options
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"{key}.{kind_key}={kind!r} has no exact counterpart in qkv (qkv's rotary has default, linear and llama3)"
        )
    options.update(rotary_scaling=kind, rotary_scaling_factor=_rope_number(params, key, "factor"))
    if kind == "llama3":
        original = data.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
        if original is None:
            original = context  # transformers' fallback
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError(f"{key}.original_max_position_embeddings={original!r} is not a positive integer")
        low, high = _rope_number(params, key, "low_freq_factor"), _rope_number(params, key, "high_freq_factor")
        if not high > low:
            raise ValueError(f"{key}.high_freq_factor={high} is not above low_freq_factor={low}")
        options.update(rotary_low_freq_factor=low, rotary_high_freq_factor=high, rotary_original_context=original)
    return options


def _rope_number(params: Mapping[str, Any], key: str, name: str) -> float:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key}.{name}={value!r} is not a positive number")
    return float(value)


def _window_options(family: str, data: Mapping[str, Any], num_layers: int) -> tuple[int | None, list[int] | None]:
    """``(sliding_window, sliding_window_layers)`` as each family's modelling code applies them:
    Llama has none, Mistral windows every layer, Qwen2 the layers ``layer_types`` marks (by default
    those from ``max_window_layers`` on) when ``use_sliding_window``."""
    if family == "llama":
        return None, None
    window = data.get("sliding_window", 4096)
    if family == "qwen2" and not data.get("use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window={window!r} is not a positive integer")
    if family == "mistral":  # MistralForCausalLM windows every layer whatever layer_types says
        if data.get("layer_types") is not None:
            logger.warning("Mistral config: layer_types is ignored; the window applies to every layer")
        return window, None
    layer_types = data.get("layer_types")
    if layer_types is None:
        first = data.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers={first!r} is not an integer")
        sliding = window is not None
        layer_types = ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(num_layers)]
    known = isinstance(layer_types, list) and all(kind in LAYER_TYPES for kind in layer_types)
    if not known or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}, got {layer_types!r}")
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if windowed and window is None:
        raise ValueError("layer_types lists sliding_attention layers but use_sliding_window gives no window")
    if not windowed:
        return None, None
    return window, None if len(windowed) == num_layers else windowed


def _bias_options(family: str, data: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(qkv_bias, bias)``: qkv's ``bias`` covers the output projection and the feed-forward
    together, ``qkv_bias`` the query/key/value projections."""
    if family == "mistral":
        return False, False
    if family == "qwen2":  # Qwen2Attention: q/k/v with biases, o_proj and the MLP without
        return True, False
    attention, mlp = data.get("attention_bias", False), data.get("mlp_bias", False)
    if not isinstance(attention, bool) or not isinstance(mlp, bool):
        raise ValueError(f"attention_bias={attention!r} and mlp_bias={mlp!r} must be true or false")
    if attention != mlp:  # Llama's attention_bias also biases o_proj, which qkv ties to the feed-forward's
        raise ValueError(
            f"mlp_bias={mlp} with attention_bias={attention}: qkv's bias covers o_proj and the feed-forward together"
        )
    return attention, attention


def read_llama_config(folder: str | Path) -> tuple[CausalLMConfig, dict[str, Any]]:
    """Read and validate ``config.json`` of a Llama, Mistral or Qwen2 folder.

    Returns:
        ``(the config, config.json's dict)``.

    Raises:
        ValueError: one line naming the file and the field.
    """
    from qkv.pretrained import read_config_dict  # here: the package imports this module

    path = Path(folder) / "config.json"
    data = read_config_dict(folder)
    try:
        return llama_config(data), data
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {_first_line(err)}") from err


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["FAMILY_DEFAULTS", "GATED_ACTIVATIONS", "LLAMA_MODEL_TYPES", "llama_config", "read_llama_config"]
