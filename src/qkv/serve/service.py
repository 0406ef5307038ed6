"""What ``qkv serve``'s routes share (:class:`Service`): the models, the model thread, a translation
batcher per translator, each model's queue (bounded: a full one answers 503 with ``Retry-After``)
and the cancellation of work whose client has gone; and the checks of a request's texts and
sampling options against the server's :class:`~qkv.serve.models.Limits`."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from qkv.decoding.steps import for_decoding
from qkv.inference.decode import DecodeConfig
from qkv.inference.engines import QkvTranslator
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.inference.policy import check_engine
from qkv.models.sampling import check_sampling
from qkv.serve.batching import DecodeKey, ModelWorker, TranslationBatcher
from qkv.serve.errors import ApiError
from qkv.serve.generation import Generations, Sampling
from qkv.serve.metrics import ServerMetrics
from qkv.serve.models import KIND_NAMES, Limits, ServedModel
from qkv.serve.schemas import GenerateRequest, TranslateRequest
from qkv.viz.app import ExplorerApp

T = TypeVar("T")
RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (its work was cancelled)."""


class Service:
    """What the routes share: the models, the explorer, the model thread and one batcher per translator."""

    def __init__(self, models: dict[str, ServedModel], explorer: ExplorerApp, limits: Limits) -> None:
        self.models, self.explorer, self.limits = models, explorer, limits
        self.worker = ModelWorker()
        generators = [name for name, served in models.items() if served.kind == CAUSAL_LM.serve_kind]
        # /metrics: each queue's depth is read at the scrape (every model, at 0 until it holds a request)
        self.metrics = ServerMetrics(lambda: {**dict.fromkeys(self.models, 0), **self.queued}, generators)
        self.batchers = {
            name: TranslationBatcher(
                self._decoder(served),
                self.worker,
                max_wait_s=limits.max_batch_wait_ms / 1000,
                max_tokens=limits.max_batch_tokens,
                metrics=self.metrics,
            )
            for name, served in models.items()
            if served.kind == SEQ2SEQ.serve_kind
        }
        self.queued: Counter[str] = Counter()  # requests waiting or running, per model (and the explorer)
        self.cancelled = 0  # requests whose client went before the answer: their work skipped or stopped
        # generation requests of each language model: continuously batched on the model thread
        self.generations = Generations(self.worker, max_rows=limits.max_generate_batch, metrics=self.metrics)

    def client_gone(self) -> None:
        """Count a request whose client went before its body was read (no work was started for it)."""
        self.cancelled += 1

    def admit(self, name: str) -> None:
        """503 with ``Retry-After`` when ``name`` already holds ``max_queue`` requests."""
        if self.queued[name] >= self.limits.max_queue:
            raise ApiError(
                503,
                f"{name!r} has {self.queued[name]} requests waiting or running, its limit; retry later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )

    async def answer(
        self, request: Request, name: str, work: Callable[[], Awaitable[T]], stop: threading.Event | None = None
    ) -> T:
        """``work()`` for a request to model ``name``, counted in its queue (503 when full) and
        cancelled if the client goes first: a job still queued for the model thread never runs, a
        generation stops at its next token (``stop`` is set at once, before the cancellation reaches
        the coroutine), a translation leaves its batch before it is decoded."""
        self.admit(name)
        self.queued[name] += 1
        task = asyncio.ensure_future(work())
        watcher = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.queued[name] -= 1
            watcher.cancel()
            gone = not task.done()
            if gone:
                if stop is not None:
                    stop.set()
                task.cancel()
        if gone:
            self.cancelled += 1
            raise ClientGone
        return task.result()

    def decode_config(self, served: ServedModel, body: TranslateRequest) -> DecodeConfig:
        """How a translate request decodes: what it asks for over the run's saved settings; its beam
        at most the server's ``max_beam`` (413 beyond; the run's own beam is capped to it). With
        another engine than qkv's, the length-penalty form is the request's or that engine's own (a
        run's saved form is qkv's), and one the engine cannot do is refused 422, as ``qkv translate
        --engine`` refuses it."""
        beam = body.beam_size if body.beam_size is not None else min(served.decode["beam_size"], self.limits.max_beam)
        if beam > self.limits.max_beam:
            raise ApiError(413, f"beam_size {beam}; the limit is {self.limits.max_beam}")
        penalty = body.penalty
        if served.engine != "qkv":
            try:
                penalty = check_engine(served.engine, penalty=body.penalty)
            except ValueError as err:  # the command line's refusal, naming the request's field
                message = str(err).replace("--length-penalty-form", "penalty")
                raise ApiError(
                    422, f"{message} (this server decodes {served.name!r} with --engine {served.engine})"
                ) from None
        return DecodeConfig.of_run(
            {"decode": served.decode},
            beam_size=beam,
            alpha=body.alpha,
            penalty=penalty,
            max_batch_tokens=self.limits.max_batch_tokens,
        )

    def _decoder(self, served: ServedModel) -> Callable[[list[str], DecodeKey], list[str]]:
        """The batcher's ``(texts, key) -> translations`` for ``served``: its own translator when it has
        one (CTranslate2's, ``--engine ctranslate2``), else qkv's engine over the model's inference
        object, built on the model thread at the first request and kept (the served weights never
        change), so no request packs the weights again."""
        budget = self.limits.max_batch_tokens
        if served.translator is not None:
            translator = served.translator
            return lambda texts, key: translator.translate(texts, DecodeConfig(*key, max_batch_tokens=budget))
        held: list[QkvTranslator] = []

        def decode(texts: list[str], key: DecodeKey) -> list[str]:
            if not held:
                held.append(QkvTranslator(for_decoding(served.model.eval()), served.tokenizer))
            return held[0].translate(texts, DecodeConfig(*key, max_batch_tokens=budget))

        return decode

    def pick(self, name: str | None, kind: str) -> ServedModel:
        """The model a request names (default: the first of ``kind``); 404 for an unknown name."""
        fitting = [served for served in self.models.values() if served.kind == kind]
        if name is None:
            if not fitting:
                raise ApiError(404, f"this server has no {KIND_NAMES[kind]} model; it serves: {self._listing()}")
            return fitting[0]
        served = self.models.get(name)
        if served is None:
            raise ApiError(404, f"unknown model {name[:80]!r}; this server serves: {self._listing()}")
        if served.kind != kind:
            raise ApiError(
                400, f"{name!r} is a {KIND_NAMES[served.kind]} model; use {served.endpoint} with it, not this endpoint"
            )
        return served

    def _listing(self) -> str:
        return ", ".join(f"{name} ({KIND_NAMES[m.kind]})" for name, m in self.models.items())

    def check_texts(self, texts: list[str], field: str = "texts") -> None:
        """Check a request's texts against the server's limits: at most ``max_texts`` of them (413
        beyond), each one as :meth:`check_text` checks it.

        Args:
            texts: the request's texts.
            field: the request field they came from, named in the error (``texts[2] ...``).

        Raises:
            ApiError: 413 for too many or too long texts, 422 for a blank or invalid one.
        """
        limits = self.limits
        if len(texts) > limits.max_texts:
            raise ApiError(413, f"{len(texts)} {field}; the limit is {limits.max_texts} per request")
        for i, text in enumerate(texts):
            self.check_text(text, f"{field}[{i}]")

    def check_text(self, text: str, field: str, *, blank_ok: bool = False) -> None:
        """Check one text of a request: not blank (unless ``blank_ok``), at most ``max_chars``
        characters, and encodable as UTF-8 (no lone surrogate).

        Args:
            text: the text.
            field: the request field it came from, named in the error.
            blank_ok: accept an empty or all-whitespace text.

        Raises:
            ApiError: 422 for a blank text or a lone surrogate, 413 for one over ``max_chars``.
        """
        if not (text if blank_ok else text.strip()):
            raise ApiError(422, f"{field} must be a non-empty string")
        if len(text) > self.limits.max_chars:
            raise ApiError(413, f"{field} has {len(text)} characters; the limit is {self.limits.max_chars}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(422, f"{field} is not valid Unicode (a lone surrogate at character {err.start})") from None


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection (its body is already read)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that cannot tell: wait for the answer alone
        await asyncio.Event().wait()


def check_encoder_lengths(served: ServedModel, texts: list[str]) -> None:
    """413 for a text longer than the encoder reads (it would be cut), as /v1/translate answers."""
    tokenizer = served.tokenizer
    backend, limit = getattr(tokenizer, "backend", None), getattr(tokenizer, "max_length", None)
    if backend is None or limit is None:
        return
    for i, encoding in enumerate(backend.encode_batch(list(texts))):
        if encoding.overflowing:
            tokens = len(encoding.ids) + sum(len(o.ids) for o in encoding.overflowing)
            raise ApiError(413, f"texts[{i}] has about {tokens} tokens; this model reads at most {limit}")


def source_tokens(served: ServedModel, texts: list[str]) -> int:
    """The texts' source tokens (with EOS); 413 for a sentence longer than the model's positions."""
    limit = served.model.config.max_len - 1
    encoded = served.tokenizer.encode_batch(texts)
    for i, ids in enumerate(encoded):
        if len(ids) > limit:
            raise ApiError(413, f"texts[{i}] has {len(ids)} tokens; this model reads at most {limit}")
    return sum(len(ids) + 1 for ids in encoded)


def sampling_of(service: Service, served: ServedModel, body: GenerateRequest) -> Sampling:
    """A generation request's sampling, its prompt, stop texts, length and rates checked (413/422)."""
    service.check_text(body.prompt, "prompt", blank_ok=True)  # a language model may continue a newline
    for i, stop in enumerate(body.stop):
        service.check_text(stop, f"stop[{i}]", blank_ok=True)  # a stop text may be spaces or newlines
    max_tokens = body.max_tokens if body.max_tokens is not None else min(128, service.limits.max_new_tokens)
    if max_tokens > service.limits.max_new_tokens:
        raise ApiError(413, f"max_tokens {max_tokens}; the limit is {service.limits.max_new_tokens}")
    try:
        ids = served.tokenizer.encode(body.prompt)
    except ValueError as err:  # a character the vocabulary lacks
        raise ApiError(422, f"prompt: {err}") from None
    if not ids:
        raise ApiError(422, "prompt gives no tokens")
    try:
        check_sampling(max_tokens, body.temperature, body.top_k, body.top_p)
    except ValueError as err:  # the range qkv generate's options share, without the command-line flag
        raise ApiError(422, re.sub(r" \(--[a-z-]+\)", "", str(err))) from None
    return Sampling(
        ids=list(ids),
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=list(body.stop),
    )
