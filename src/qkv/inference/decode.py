"""How a translation decodes: a run's saved settings (beam size, length penalty) and the one typed
object every engine takes (:class:`DecodeConfig`).

A recipe's ``decode`` is stored in the run's ``config.json`` when the run starts; ``qkv translate``,
``qkv evaluate``, ``qkv serve`` and the exporters read it back here (re-exported by
:mod:`qkv.runs.recipes`, where qkv 1.x defined it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.decoding.search import PenaltyForm

# How a translation run decodes when qkv evaluate / translate get no --beam / --alpha: a recipe's
# "decode" (stored in the run's config.json when it starts), else this.
DEFAULT_DECODE: dict[str, Any] = {"beam_size": 5, "alpha": 0.6}
MAX_SAVED_BEAM = 100  # as qkv translate --beam: beam search holds that many copies of each sentence
PENALTY_FORMS: tuple[PenaltyForm, ...] = ("gnmt", "power")

__all__ = ["DEFAULT_DECODE", "MAX_SAVED_BEAM", "PENALTY_FORMS", "DecodeConfig", "check_decode", "decode_settings"]


def check_decode(decode: object, where: str) -> dict[str, Any]:
    """``decode`` checked: an object with some of ``beam_size`` (1 to :data:`MAX_SAVED_BEAM`) and
    ``alpha`` (0 to 10). Returns it with :data:`DEFAULT_DECODE` under it.

    Args:
        decode: the settings to check (a dict, or None for none).
        where: what holds them, named in the error (``config.json``, a recipe file).

    Raises:
        ValueError: one line naming ``where``, the key and the value.
    """
    saved = decode or {}
    if not isinstance(saved, dict) or set(saved) - set(DEFAULT_DECODE):
        raise ValueError(f"{where}: decode must be an object with {sorted(DEFAULT_DECODE)}, got {saved!r}"[:300])
    settings = {**DEFAULT_DECODE, **saved}
    beam, penalty = settings["beam_size"], settings["alpha"]
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= MAX_SAVED_BEAM:
        raise ValueError(f"{where}: decode.beam_size must be an integer from 1 to {MAX_SAVED_BEAM}, got {beam!r}")
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not 0 <= penalty <= 10:
        raise ValueError(f"{where}: decode.alpha must be a number from 0 to 10, got {penalty!r}")
    return settings


def decode_settings(config: dict, *, beam_size: int | None = None, alpha: float | None = None) -> dict:
    """Beam size and length penalty for a run: the ones given, else the run's own (its recipe's),
    else :data:`DEFAULT_DECODE`.

    Args:
        config: the run's config.json (its ``decode``, when it has one, is checked).
        beam_size: a beam size that goes over the run's.
        alpha: a length penalty that goes over the run's.

    Returns:
        ``{"beam_size": ..., "alpha": ...}``.
    """
    settings = check_decode(config.get("decode"), "config.json")
    if beam_size is not None:
        settings["beam_size"] = beam_size
    if alpha is not None:
        settings["alpha"] = alpha
    return settings


@dataclass(frozen=True)
class DecodeConfig:
    """How one call of a :class:`~qkv.inference.engines.Translator` decodes; checked when made.

    Args:
        beam_size: 1 = greedy, else beam search with that many hypotheses (1 to :data:`MAX_SAVED_BEAM`).
        alpha: the length penalty's exponent (0 to 10).
        penalty: its form, ``"gnmt"`` (qkv's) or ``"power"`` (CTranslate2's and Hugging Face's), see
            :func:`qkv.decoding.search.length_penalty`; None: the engine's own (``ENGINES[name].penalties[0]``).
        max_tokens: source tokens per batch (times ``beam_size`` rows are decoded at once).
    """

    beam_size: int = 1
    alpha: float = 0.6
    penalty: PenaltyForm | None = None
    max_tokens: int = 4000

    def __post_init__(self) -> None:
        check_decode({"beam_size": self.beam_size, "alpha": self.alpha}, "DecodeConfig")
        if self.penalty is not None and self.penalty not in PENALTY_FORMS:
            raise ValueError(f"DecodeConfig: penalty must be one of {', '.join(PENALTY_FORMS)}, got {self.penalty!r}")
        tokens = self.max_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"DecodeConfig: max_tokens must be an integer >= 1, got {tokens!r}")

    @classmethod
    def of_run(
        cls,
        config: dict,
        *,
        beam_size: int | None = None,
        alpha: float | None = None,
        penalty: PenaltyForm | None = None,
        max_tokens: int = 4000,
    ) -> DecodeConfig:
        """A run's own settings (:func:`decode_settings`), with the ones given over them.

        Args:
            config: the run's config.json.
            beam_size, alpha: over the run's when given.
            penalty, max_tokens: as the class takes them.

        Returns:
            The checked config.
        """
        settings = decode_settings(config, beam_size=beam_size, alpha=alpha)
        return cls(settings["beam_size"], settings["alpha"], penalty, max_tokens)
