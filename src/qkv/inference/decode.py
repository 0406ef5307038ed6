"""How a translation decodes: :class:`DecodeConfig`, every decoding option declared once (default,
range, help, flag), and a run's saved settings.

A recipe's ``decode`` (beam size, length penalty and its form) is stored whole in the run's
``config.json`` when the run starts; ``qkv translate``, ``qkv evaluate``, ``qkv serve`` and the
exporters read it back here (re-exported by :mod:`qkv.runs.recipes`, where qkv 1.x defined it). A run
folder saved before the form was stored decodes with ``"gnmt"``, the form qkv 1.x always used.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from typing import Any

from qkv.decoding.search import PenaltyForm

#: the largest beam size anything decodes with (the command line, a recipe's or run's saved decode,
#: the server's --max-beam): beam search holds that many copies of each sentence at once
MAX_BEAM = 100
MAX_SAVED_BEAM = MAX_BEAM  # qkv 1.x's name for the recipes' limit
PENALTY_FORMS: tuple[PenaltyForm, ...] = ("gnmt", "power")
#: the options a run saves in config.json's "decode" (the rest are the caller's, per call)
SAVED_FIELDS = ("beam_size", "alpha", "penalty")

__all__ = [
    "DEFAULT_DECODE",
    "MAX_BEAM",
    "MAX_SAVED_BEAM",
    "PENALTY_FORMS",
    "SAVED_FIELDS",
    "DecodeConfig",
    "check_decode",
    "decode_option",
    "decode_settings",
]


def decode_option(
    default: Any,
    help: str,
    *,
    flag: str,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    integer: bool = False,
) -> Any:
    """A :class:`DecodeConfig` field with its range, help and flag, declared once.

    Args:
        default: the value when nothing sets it.
        help: the command-line help.
        flag: the command-line flag that sets it.
        minimum, maximum: the allowed range (inclusive; None: unbounded).
        choices: the allowed values of a string field (None is always allowed for one).
        integer: the value must be an integer (else any finite number).

    Returns:
        A dataclass field whose metadata holds the above.
    """
    meta = {"help": help, "flag": flag, "minimum": minimum, "maximum": maximum, "choices": choices}
    return field(default=default, metadata={**meta, "integer": integer})


def check_value(option: Field, value: Any, name: str) -> Any:
    """``value`` checked against ``option``'s declared range; ``ValueError`` in one line naming
    ``name`` (what holds the value) and the allowed range."""
    meta = option.metadata
    if meta["choices"] is not None:
        if value is not None and value not in meta["choices"]:
            raise ValueError(f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}")
        return value
    low, high = meta["minimum"], meta["maximum"]
    kind = "an integer" if meta["integer"] else "a number"
    span = f"from {low:g} to {high:g}" if high is not None else f">= {low:g}"
    number = isinstance(value, int) or (isinstance(value, float) and not meta["integer"] and math.isfinite(value))
    if isinstance(value, bool) or not number or value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {kind} {span}, got {value!r}"[:300])
    return value


@dataclass(frozen=True)
class DecodeConfig:
    """How one call of a :class:`~qkv.inference.engines.Translator` decodes; checked when made
    against each field's declaration (:func:`decode_option`), from which the command line's flags
    take their ranges too.

    Args:
        beam_size: 1 = greedy, else beam search with that many hypotheses (1 to :data:`MAX_BEAM`).
        alpha: the length penalty's exponent (0 to 10).
        penalty: its form, ``"gnmt"`` (qkv's) or ``"power"`` (CTranslate2's and Hugging Face's), see
            :func:`qkv.decoding.search.length_penalty`; None: the engine's own (``ENGINES[name].penalties[0]``).
        max_batch_tokens: source tokens per batch (times ``beam_size`` rows are decoded at once).
    """

    beam_size: int = decode_option(
        1, "beam size (1 = greedy)", flag="--beam", minimum=1, maximum=MAX_BEAM, integer=True
    )
    alpha: float = decode_option(0.6, "length penalty exponent", flag="--alpha", minimum=0, maximum=10)
    penalty: PenaltyForm | None = decode_option(
        None, "the length penalty's form", flag="--length-penalty-form", choices=PENALTY_FORMS
    )
    max_batch_tokens: int = decode_option(
        4000, "source tokens times beam size in one decoding batch", flag="--max-batch-tokens", minimum=1, integer=True
    )

    def __post_init__(self) -> None:
        for option in fields(self):
            check_value(option, getattr(self, option.name), f"DecodeConfig: {option.name} ({option.metadata['flag']})")

    def saved(self) -> dict[str, Any]:
        """The settings a run or an export saves (``config.json``'s or a manifest's ``decode``)."""
        return {name: getattr(self, name) for name in SAVED_FIELDS}

    @classmethod
    def option(cls, name: str) -> Field:
        """The declaration of the field ``name`` (its default, range, help and flag in ``metadata``)."""
        return next(option for option in fields(cls) if option.name == name)

    @classmethod
    def of_run(
        cls,
        config: dict,
        *,
        beam_size: int | None = None,
        alpha: float | None = None,
        penalty: PenaltyForm | None = None,
        max_batch_tokens: int | None = None,
    ) -> DecodeConfig:
        """A run's own settings (:func:`decode_settings`: its saved ``decode``, penalty form included),
        with the ones given over them.

        Args:
            config: the run's config.json.
            beam_size: over the run's when given.
            alpha: over the run's when given.
            penalty: over the run's when given.
            max_batch_tokens: source tokens times beam size per batch (None: the default).

        Returns:
            The checked config.
        """
        settings = decode_settings(config, beam_size=beam_size, alpha=alpha, penalty=penalty)
        return cls(**settings) if max_batch_tokens is None else cls(**settings, max_batch_tokens=max_batch_tokens)


# How a translation run decodes when nothing says otherwise: a recipe's "decode" (stored whole in
# the run's config.json when it starts), else this; "gnmt" is also what a run saved without a form used
DEFAULT_DECODE: dict[str, Any] = {"beam_size": 5, "alpha": 0.6, "penalty": "gnmt"}


def check_decode(decode: object, where: str) -> dict[str, Any]:
    """``decode`` checked: an object with some of :data:`SAVED_FIELDS`, each within
    :class:`DecodeConfig`'s declared range. Returns it with :data:`DEFAULT_DECODE` under it.

    Args:
        decode: the settings to check (a dict, or None for none).
        where: what holds them, named in the error (``config.json``, a recipe file).

    Returns:
        All of :data:`SAVED_FIELDS`.

    Raises:
        ValueError: one line naming ``where``, the key and the value.
    """
    saved = decode or {}
    if not isinstance(saved, dict) or set(saved) - set(DEFAULT_DECODE):
        raise ValueError(f"{where}: decode must be an object with {sorted(DEFAULT_DECODE)}, got {saved!r}"[:300])
    settings = {**DEFAULT_DECODE, **saved}
    if settings["penalty"] is None:
        raise ValueError(f"{where}: decode.penalty must be one of {', '.join(PENALTY_FORMS)}, got None")
    for name in SAVED_FIELDS:
        check_value(DecodeConfig.option(name), settings[name], f"{where}: decode.{name}")
    return settings


def decode_settings(
    config: dict, *, beam_size: int | None = None, alpha: float | None = None, penalty: PenaltyForm | None = None
) -> dict:
    """Beam size, length penalty and its form for a run: the ones given, else the run's own (its
    recipe's, saved in config.json), else :data:`DEFAULT_DECODE`.

    Args:
        config: the run's config.json (its ``decode``, when it has one, is checked).
        beam_size: a beam size that goes over the run's.
        alpha: a length penalty that goes over the run's.
        penalty: a length-penalty form that goes over the run's.

    Returns:
        ``{"beam_size": ..., "alpha": ..., "penalty": ...}``.
    """
    settings = check_decode(config.get("decode"), "config.json")
    given = {"beam_size": beam_size, "alpha": alpha, "penalty": penalty}
    return settings | {name: value for name, value in given.items() if value is not None}
