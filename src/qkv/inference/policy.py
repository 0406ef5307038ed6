"""Which engine decodes, and what each can do: the one table the command line and the library check.

Each engine of :mod:`qkv.inference` has an :class:`EngineInfo` in :data:`ENGINES`: its length-penalty
forms (the first is its default), whether it decodes ensembles, beam search and bf16 autocast, and
whether it reads other runs. :func:`check_engine` refuses, in one line, what the chosen engine cannot
do; ``qkv translate`` and ``qkv evaluate`` call it through :func:`qkv.cli.options.check_engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qkv.decoding.search import PenaltyForm

__all__ = ["ENGINES", "EngineInfo", "check_engine"]


@dataclass(frozen=True)
class EngineInfo:
    """What one engine supports.

    Args:
        name: the engine's name (``--engine``).
        penalties: the length-penalty forms it has; the first is its default.
        ensemble: it decodes several runs' averaged probabilities.
        beam: it runs beam search (else greedy only).
        bf16: qkv's bfloat16 autocast applies to it.
        quantization: it takes a CTranslate2 compute type.
    """

    name: str
    penalties: tuple[PenaltyForm, ...]
    ensemble: bool
    beam: bool
    bf16: bool
    quantization: bool


ENGINES = {
    "qkv": EngineInfo("qkv", ("gnmt", "power"), ensemble=True, beam=True, bf16=True, quantization=False),
    "ctranslate2": EngineInfo("ctranslate2", ("power",), ensemble=False, beam=True, bf16=False, quantization=True),
    "onnx": EngineInfo("onnx", ("gnmt", "power"), ensemble=False, beam=False, bf16=False, quantization=False),
}


def check_engine(
    engine: str,
    *,
    penalty: PenaltyForm | None = None,
    quantization: str | None = None,
    ensemble: bool = False,
    bf16: bool = False,
    beam_size: int | None = None,
    other_runs: Sequence[str] = (),
) -> PenaltyForm:
    """The length-penalty form ``engine`` decodes with, once the options agree with what it can do.

    Args:
        engine: a name in :data:`ENGINES`.
        penalty: the form asked for (None: the engine's default).
        quantization: a CTranslate2 compute type asked for (None: none).
        ensemble: several runs are to be decoded together.
        bf16: qkv's bfloat16 autocast is asked for.
        beam_size: the beam size asked for (None: the engine's default).
        other_runs: run folders to decode besides (``qkv evaluate --against``).

    Returns:
        The form: the one asked for, else the engine's default.

    Raises:
        ValueError: one line saying what the engine cannot do and what to use instead.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
    info = ENGINES[engine]
    if quantization is not None and not info.quantization:
        raise ValueError(
            f"--quantization {quantization} is CTranslate2's compute type: it applies to --engine ctranslate2 only"
        )
    if penalty is not None and penalty not in info.penalties:
        raise ValueError(
            f"--length-penalty-form {penalty}: CTranslate2 divides by len ** alpha only; use --length-penalty-form "
            "power (its default) or --engine qkv"
        )
    if ensemble and not info.ensemble:
        raise ValueError(f"--ensemble: {_decodes_one(engine)}; use --engine qkv for an ensemble")
    if beam_size is not None and beam_size > 1 and not info.beam:
        raise ValueError(f"--beam {beam_size}: the {engine} engine decodes greedily only; use --beam 1 or --engine qkv")
    if bf16 and not info.bf16:
        instead = "use --quantization bfloat16" if info.quantization else "use --engine qkv"
        raise ValueError(f"--bf16 is qkv's autocast; with --engine {engine} {instead}")
    if other_runs and engine != "qkv":
        raise ValueError(
            f"--against {other_runs[0]}: other runs are decoded by qkv; with --engine {engine} pass their "
            "translations as a file, or use --engine qkv"
        )
    return penalty or info.penalties[0]


def _decodes_one(engine: str) -> str:
    return "CTranslate2 decodes one model" if engine == "ctranslate2" else f"the {engine} engine decodes one model"
