"""The models ``qkv serve`` serves, opened by kind, and the limits every request is held to.

Each ``--model`` folder is opened once, with :func:`qkv.viz.explorers.open_explorer`, and its kind
decides its endpoints: a translation run serves ``POST /v1/translate``, a language model (a qkv LM
run, or a GPT-2, Llama, Mistral or Qwen2 folder) ``POST /v1/generate``, a BERT-family encoder
``POST /v1/embed``; every model is also in the attention explorer. The explorer and the endpoint
share one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.inference.decode import DecodeConfig, check_value, decode_settings
from qkv.inference.engines import Translator
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.inference.runs import is_run_folder, read_run_config
from qkv.runtime.device import model_device
from qkv.viz.explorers import ENCODER_KIND, Explorer, open_explorer

# the explorer's kind -> the endpoint that serves it, and the kind in words
ENDPOINTS = {SEQ2SEQ.serve_kind: "/v1/translate", CAUSAL_LM.serve_kind: "/v1/generate", ENCODER_KIND: "/v1/embed"}
SERVE_ENGINES = ("qkv", "ctranslate2")  # what may decode a translation run's requests (--engine)
KIND_NAMES = {SEQ2SEQ.serve_kind: SEQ2SEQ.title, CAUSAL_LM.serve_kind: CAUSAL_LM.title, ENCODER_KIND: "encoder"}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how translation requests are batched.

    Args:
        max_chars: the longest text (a sentence, a prompt, a stop text) in characters.
        max_texts: the most texts in one translation or embedding request.
        max_new_tokens: the most tokens one generation request may produce.
        max_beam: the largest beam size a request may ask for (this deployment's; at most
            :data:`qkv.inference.decode.MAX_BEAM`, the one beam limit).
        max_body_bytes: the largest request body; a longer one is answered 413 before it is parsed.
        max_batch_wait_ms: how long the first translation request of a batch waits for others to join
            it; 0 turns batching off (each request is decoded alone, one after another).
        max_batch_tokens: source tokens (times the beam size) decoded in one batch.
        max_generate_batch: generation requests of one language model decoded together, joining and
            leaving between steps (continuous batching); 1: one at a time, in arrival order.
        max_queue: requests one model (or the explorer) may hold, waiting or running; one more is
            answered 503 with ``Retry-After``.
        header_timeout_s: seconds a connection has to send a request's headers (from when it opens,
            or from the end of its previous answer); then it gets 408 and is closed.
        body_timeout_s: seconds a request has to send its body once its headers are in.
        max_connections: open connections at most; None: as many as the process's open-file limit
            leaves room for (:func:`qkv.serve.connections.connection_cap`).
    """

    max_chars: int = 500
    max_texts: int = 64
    max_new_tokens: int = 512
    max_beam: int = 16
    max_body_bytes: int = 262_144
    max_batch_wait_ms: float = 5.0
    max_batch_tokens: int = 4000
    max_queue: int = 32
    max_generate_batch: int = 32
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        names = ["max_chars", "max_texts", "max_new_tokens", "max_beam", "max_body_bytes", "max_batch_tokens"]
        names += ["max_queue", "max_generate_batch", *(["max_connections"] if self.max_connections is not None else [])]
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_value(DecodeConfig.option("beam_size"), self.max_beam, "max_beam (--max-beam)")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"{name} must be between 0 and 3600 seconds (more than 0), got {value!r}")
        wait = self.max_batch_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 10_000:
            raise ValueError(f"max_batch_wait_ms must be between 0 and 10000 milliseconds, got {wait!r}")


@dataclass
class ServedModel:
    """One model: its explorer (which holds the model and tokenizer), its kind, and for a translation
    run the beam size, length penalty and its form the run saved (a request's defaults)."""

    name: str
    explorer: Explorer
    decode: dict[str, Any] = field(default_factory=dict)
    translator: Translator | None = None  # a translation run's engine besides qkv's (``--engine``), or None
    folder: Path | None = None  # the folder it was opened from (its chat template, if any), or None

    @property
    def engine(self) -> str:
        """What decodes the model's answers: ``"qkv"``, or its :attr:`translator`'s engine (``"ctranslate2"``)."""
        return self.translator.name if self.translator is not None else "qkv"

    @property
    def kind(self) -> str:
        """The explorer's kind of model: ``"seq2seq"``, ``"lm"`` or ``"encoder"``."""
        return self.explorer.kind

    @property
    def endpoint(self) -> str:
        """The route that serves the model, by its kind (``/v1/translate``, ``/v1/generate`` or ``/v1/embed``)."""
        return ENDPOINTS[self.kind]

    @property
    def model(self) -> Any:
        """The model itself, the one the explorer holds (one copy of the weights for both)."""
        return self.explorer.model

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, the one the explorer holds."""
        return self.explorer.tokenizer


def served_model(explorer: Explorer, folder: str | Path | None = None) -> ServedModel:
    """A :class:`ServedModel` of an open explorer; a translation run's recipe gives its decoding defaults."""
    decode: dict[str, Any] = {}
    if explorer.kind == SEQ2SEQ.serve_kind:
        config = read_run_config(folder) if folder is not None and is_run_folder(folder) else {}
        decode = decode_settings(config)  # a run saved without a form decodes with gnmt, as before
    where = Path(folder) if folder is not None else None
    return ServedModel(name=explorer.name, explorer=explorer, decode=decode, folder=where)


def open_models(
    paths: Iterable[str | Path | None], *, engine: str = "qkv", threads: int | None = None
) -> dict[str, ServedModel]:
    """Open every folder (None: the default all-MiniLM-L6-v2); two folders of the same name are told
    apart by a suffix (``run``, ``run-2``). With ``engine="ctranslate2"`` each translation run is also
    converted for CTranslate2 (:func:`ctranslate2_engine`, ``threads`` its CPU threads; 0 or None: its
    default); other models keep qkv's engine. Raises one-line ``FileNotFoundError`` / ``ValueError``."""
    if engine not in SERVE_ENGINES:
        raise ValueError(f"engine {engine!r}: qkv serve decodes with {' or '.join(SERVE_ENGINES)}")
    models: dict[str, ServedModel] = {}
    for path in paths:
        explorer = open_explorer(path)
        name, suffix = explorer.name, 2
        while name in models:
            name, suffix = f"{explorer.name}-{suffix}", suffix + 1
        explorer.name = name
        models[name] = served = served_model(explorer, path)
        if engine == "ctranslate2" and served.kind == SEQ2SEQ.serve_kind and path is not None:
            served.translator = ctranslate2_engine(path, model_device(served.model).type, threads)
    if not models:
        raise ValueError("no models to serve")
    return models


def ctranslate2_engine(run_dir: str | Path, device_type: str = "cpu", threads: int | None = None) -> Translator:
    """A translation run converted for CTranslate2 as ``qkv translate --engine ctranslate2`` converts
    it (:func:`qkv.export.ctranslate2.open_translator`: a float32 export, checked, in a temporary folder;
    or the folder itself when it is an export), loaded into memory; the temporary folder is gone on return.

    Args:
        run_dir: the translation run folder (or a ``qkv export --to ctranslate2`` folder).
        device_type: the served model's device type; CUDA when CTranslate2 has it (else the CPU).
        threads: CTranslate2's CPU threads (0 or None: its own default).

    Returns:
        the translator (a :class:`~qkv.inference.ctranslate2.Ct2Translator`).

    Raises:
        ValueError: ctranslate2 is not installed, or the run has no CTranslate2 counterpart.
    """
    try:
        from qkv.export.ctranslate2 import open_translator
        from qkv.inference.ctranslate2 import ct2_device
    except ImportError as err:
        raise ValueError(f"--engine ctranslate2 needs ctranslate2: pip install 'qkv[deploy]' ({err})") from None
    with open_translator(run_dir, device=ct2_device(device_type, None), threads=threads or 0) as translator:
        return translator  # CTranslate2 has read the model: the temporary export may go
