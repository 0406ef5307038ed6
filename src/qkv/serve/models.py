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
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.inference.runs import is_run_folder, read_run_config
from qkv.viz.explorers import ENCODER_KIND, Explorer, open_explorer

# the explorer's kind -> the endpoint that serves it, and the kind in words
ENDPOINTS = {SEQ2SEQ.serve_kind: "/v1/translate", CAUSAL_LM.serve_kind: "/v1/generate", ENCODER_KIND: "/v1/embed"}
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
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        names = ["max_chars", "max_texts", "max_new_tokens", "max_beam", "max_body_bytes", "max_batch_tokens"]
        names += ["max_queue", *(["max_connections"] if self.max_connections is not None else [])]
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
    return ServedModel(name=explorer.name, explorer=explorer, decode=decode)


def open_models(paths: Iterable[str | Path | None]) -> dict[str, ServedModel]:
    """Open every folder (None: the default all-MiniLM-L6-v2); two folders of the same name are told
    apart by a suffix (``run``, ``run-2``). Raises one-line ``FileNotFoundError`` / ``ValueError``."""
    models: dict[str, ServedModel] = {}
    for path in paths:
        explorer = open_explorer(path)
        name, suffix = explorer.name, 2
        while name in models:
            name, suffix = f"{explorer.name}-{suffix}", suffix + 1
        explorer.name = name
        models[name] = served_model(explorer, path)
    if not models:
        raise ValueError("no models to serve")
    return models
