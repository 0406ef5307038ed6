"""The :class:`Translator` protocol, and qkv's own engine.

Three engines translate a list of sentences with one interface: :class:`QkvTranslator` (qkv's
batched greedy and beam search, :func:`qkv.decoding.translate.translate_texts`),
:class:`~qkv.inference.ctranslate2.Ct2Translator` (a CTranslate2 export) and
:class:`~qkv.inference.onnx_runtime.OnnxTranslator` (an ONNX export, greedy). What each can do is
:data:`qkv.inference.policy.ENGINES`; :func:`open_translator` opens one by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from qkv.data.tokenizer import Tokenizer
from qkv.decoding import translate as batched
from qkv.decoding.ensemble import Ensemble
from qkv.decoding.steps import Decodable
from qkv.inference.decode import DecodeConfig
from qkv.inference.policy import check_engine
from qkv.inference.runs import load_translator

__all__ = ["QkvTranslator", "Translator", "open_translator"]


@runtime_checkable
class Translator(Protocol):
    """What every engine is: ``translate(texts, decode) -> translations`` in input order, a ``name``
    (a key of :data:`qkv.inference.policy.ENGINES`) and ``close()``. ``decode`` None: the engine's
    own settings (a run's recipe, a manifest's; greedy for ONNX)."""

    name: str

    def translate(self, texts: list[str], decode: DecodeConfig | None = None) -> list[str]:
        """Translate ``texts``.

        Args:
            texts: the source sentences.
            decode: how to decode; None: the engine's own settings.

        Returns:
            One translation per sentence, in input order.
        """
        ...

    def close(self) -> None:
        """Free what the engine holds (an onnxruntime session, CTranslate2's model); a closed engine may
        translate no more."""
        ...


class QkvTranslator:
    """qkv's own engine: a trained Transformer (or an :class:`~qkv.decoding.ensemble.Ensemble`) and its
    tokenizer, decoded by :func:`qkv.decoding.translate.translate_texts`.

    Args:
        model: the model (put in eval mode), an ensemble, or an inference object the caller keeps.
        tokenizer: its tokenizer.
        config: the run's config.json (its saved ``decode``, beam size, alpha and penalty form, is the
            default decoding).
        bf16: decode under bfloat16 autocast.
        progress: show a progress bar.
    """

    name = "qkv"

    def __init__(
        self,
        model: Decodable,
        tokenizer: Tokenizer,
        *,
        config: dict | None = None,
        bf16: bool = False,
        progress: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config or {}
        self.bf16, self.progress = bf16, progress

    @classmethod
    def open(cls, run_dirs: Sequence[str | Path], weights: str = "model", *, bf16: bool = False) -> QkvTranslator:
        """One translation run, or several as an ensemble (:func:`qkv.inference.runs.load_translator`).

        Args:
            run_dirs: the run folders; the first one's config speaks for all.
            weights: which of their weights (``model``, ``best``, ``last``, ``ema``).
            bf16: decode under bfloat16 autocast.

        Returns:
            The translator, on the CPU (move ``translator.model`` to a device).
        """
        model, tokenizer, config = load_translator(run_dirs, weights)
        return cls(model, tokenizer, config=config, bf16=bf16)

    @property
    def default_decode(self) -> DecodeConfig:
        """The run's own beam size, length penalty and its form (saved in config.json; a run saved
        without a form: GNMT's)."""
        return DecodeConfig.of_run(self.config)

    def translate(self, texts: list[str], decode: DecodeConfig | None = None) -> list[str]:
        """Translate ``texts`` (batched by length; output in input order).

        Args:
            texts: source sentences.
            decode: how (None: :attr:`default_decode`).

        Returns:
            the translations, one per input sentence.
        """
        decode = decode or self.default_decode
        penalty = check_engine(
            self.name, penalty=decode.penalty, ensemble=isinstance(self.model, Ensemble), bf16=self.bf16
        )
        # looked up when called: qkv 1.x's translate and evaluate called the module's function, which
        # scripts and tests replace (monkeypatch) to fix the translations
        return batched.translate_texts(
            self.model,
            self.tokenizer,
            texts,
            beam_size=decode.beam_size,
            alpha=decode.alpha,
            penalty=penalty,
            max_batch_tokens=decode.max_batch_tokens,
            bf16=self.bf16,
            progress=self.progress,
        )

    def close(self) -> None:
        """Nothing to free: the model is the caller's (it is kept until this object is dropped)."""


def open_translator(engine: str, source: str | Path, *, threads: int | None = None, **options: object) -> Translator:
    """An engine by name over a folder it reads.

    Args:
        engine: ``"qkv"`` (a translation run folder), ``"ctranslate2"`` (a folder ``qkv export --to
            ctranslate2`` wrote; converting a run is :func:`qkv.export.ctranslate2.open_translator`) or
            ``"onnx"`` (a folder ``qkv export --to onnx`` wrote).
        source: the folder.
        threads: the engine's CPU threads (CTranslate2 and ONNX Runtime; qkv's are the process's).
        options: the engine's own keyword arguments (``weights`` and ``bf16`` for qkv; ``device`` and
            ``compute_type`` for CTranslate2; ``providers`` for ONNX Runtime).

    Returns:
        The translator; ``close()`` it when done.

    Raises:
        ValueError: an unknown engine, or options it does not take.
    """
    check_engine(engine)
    if engine == "qkv":
        return QkvTranslator.open([source], **options)  # type: ignore[arg-type]
    if engine == "ctranslate2":
        from qkv.inference.ctranslate2 import Ct2Translator

        return Ct2Translator(source, threads=threads or 0, **options)  # type: ignore[arg-type]
    from qkv.inference.onnx_runtime import OnnxTranslator

    return OnnxTranslator(source, threads=threads, **options)  # type: ignore[arg-type]
