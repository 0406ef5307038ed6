"""The FastAPI application of ``qkv serve``.

Routes:
    ``POST /v1/translate``  ``{"texts": [...], "beam_size", "alpha", "penalty", "model"}`` -> translations
                            (concurrent requests are batched dynamically: :mod:`qkv.serve.batching`)
    ``POST /v1/generate``   ``{"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                            "stream", "model"}`` -> server-sent events (:mod:`qkv.serve.streaming`)
    ``POST /v1/embed``      ``{"texts": [...], "normalize", "model"}`` -> sentence embeddings
    ``GET /v1/models``      every model: its name, kind and endpoint
    ``GET /``, ``GET /api/models``, ``POST /api/attend``  the attention explorer (:class:`qkv.viz.app.ExplorerApp`)
    ``GET /health``         ``{"status": "ok", ...}``; ``GET /docs``: the OpenAPI documentation

Every error is ``{"error": "<one line>"}`` (:mod:`qkv.serve.errors`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from qkv import __version__
from qkv.decoding.translate import translate_texts
from qkv.serve.batching import DecodeKey, ModelWorker, TranslationBatcher
from qkv.serve.errors import ApiError, BoundedBodies, Utf8JSONResponse, install_error_handlers, parse_json
from qkv.serve.models import KIND_NAMES, Limits, ServedModel
from qkv.serve.schemas import (
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    TranslateRequest,
    TranslateResponse,
)
from qkv.serve.streaming import Sampling, generate_text, stream_events
from qkv.viz.app import ExplorerApp, RequestError


class Service:
    """What the routes share: the models, the explorer, the model thread and one batcher per translator."""

    def __init__(self, models: dict[str, ServedModel], explorer: ExplorerApp, limits: Limits) -> None:
        self.models, self.explorer, self.limits = models, explorer, limits
        self.worker = ModelWorker()
        self.batchers = {
            name: TranslationBatcher(
                self._decoder(served),
                self.worker,
                max_wait_s=limits.max_batch_wait_ms / 1000,
                max_tokens=limits.max_batch_tokens,
            )
            for name, served in models.items()
            if served.kind == "seq2seq"
        }

    def _decoder(self, served: ServedModel) -> Any:
        budget = self.limits.max_batch_tokens

        def decode(texts: list[str], key: DecodeKey) -> list[str]:
            return translate_texts(
                served.model,
                served.tokenizer,
                texts,
                beam_size=key.beam_size,
                alpha=key.alpha,
                penalty=key.penalty,
                max_tokens=budget,
            )

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
        limits = self.limits
        if len(texts) > limits.max_texts:
            raise ApiError(413, f"{len(texts)} {field}; the limit is {limits.max_texts} per request")
        for i, text in enumerate(texts):
            self.check_text(text, f"{field}[{i}]")

    def check_text(self, text: str, field: str, *, blank_ok: bool = False) -> None:
        if not (text if blank_ok else text.strip()):
            raise ApiError(422, f"{field} must be a non-empty string")
        if len(text) > self.limits.max_chars:
            raise ApiError(413, f"{field} has {len(text)} characters; the limit is {self.limits.max_chars}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(422, f"{field} is not valid Unicode (a lone surrogate at character {err.start})") from None


def create_app(models: dict[str, ServedModel], explorer: ExplorerApp, limits: Limits | None = None) -> FastAPI:
    """The application serving ``models`` (and ``explorer``, the attention explorer of the same models)."""
    service = Service(models, explorer, limits or Limits())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        service.worker.close()

    app = FastAPI(
        title="qkv serve",
        version=__version__,
        description="Translation, generation and embeddings from qkv models, and the attention explorer.",
        lifespan=lifespan,
        default_response_class=Utf8JSONResponse,
    )
    app.state.service = service
    install_error_handlers(app)
    app.add_middleware(BoundedBodies, max_bytes=service.limits.max_body_bytes)
    add_api_routes(app, service)
    add_explorer_routes(app, service)
    return app


def add_api_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/translate", response_model=TranslateResponse)
    async def translate(body: TranslateRequest) -> dict[str, Any]:
        """Translate a batch of sentences (beam search with a length penalty; beam_size 1 = greedy)."""
        served = service.pick(body.model, "seq2seq")
        service.check_texts(body.texts)
        beam = (
            body.beam_size if body.beam_size is not None else min(served.decode["beam_size"], service.limits.max_beam)
        )
        if beam > service.limits.max_beam:
            raise ApiError(413, f"beam_size {beam}; the limit is {service.limits.max_beam}")
        alpha = body.alpha if body.alpha is not None else float(served.decode["alpha"])
        tokens = _source_tokens(served, body.texts)
        key = DecodeKey(beam, alpha, body.penalty)
        translations = await service.batchers[served.name].translate(body.texts, key, tokens)
        return {"model": served.name, "translations": translations, **key._asdict()}

    @app.post(
        "/v1/generate",
        response_model=GenerateResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "the tokens as server-sent events"}},
    )
    async def generate(body: GenerateRequest) -> Any:
        """Continue a prompt with a language model: server-sent events (``data: {"text": ...}`` as the
        text grows, then ``event: done``), or one JSON answer with ``"stream": false``."""
        served = service.pick(body.model, "lm")
        sampling = _sampling(service, served, body)
        if not body.stream:
            return {
                "model": served.name,
                **await generate_text(service.worker, served.model, served.tokenizer, sampling),
            }
        events = stream_events(service.worker, served.model, served.tokenizer, sampling)
        return StreamingResponse(events, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})

    @app.post("/v1/embed", response_model=EmbedResponse)
    async def embed(body: EmbedRequest) -> dict[str, Any]:
        """Mean-pooled (by default L2-normalised) sentence embeddings from an encoder, as ``qkv embed`` makes."""
        from qkv.pretrained import sentence_embeddings

        served = service.pick(body.model, "encoder")
        service.check_texts(body.texts)
        vectors = await service.worker.run(
            lambda: sentence_embeddings(served.model, body.texts, normalize=body.normalize)
        )
        return {
            "model": served.name,
            "dimension": vectors.size(1),
            "normalized": body.normalize,
            "embeddings": vectors.tolist(),
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every model served: its name, kind and endpoint."""
        return {
            "models": [
                {"name": name, "kind": KIND_NAMES[m.kind], "endpoint": m.endpoint} for name, m in service.models.items()
            ]
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The server is up; which models it serves, and how many translation batches each has decoded."""
        return {
            "status": "ok",
            "models": {name: KIND_NAMES[m.kind] for name, m in service.models.items()},
            "translation_batches": {name: batcher.batches for name, batcher in service.batchers.items()},
        }


def _source_tokens(served: ServedModel, texts: list[str]) -> int:
    """The texts' source tokens (with EOS); 413 for a sentence longer than the model's positions."""
    limit = served.model.config.max_len - 1
    encoded = served.tokenizer.encode_batch(texts)
    for i, ids in enumerate(encoded):
        if len(ids) > limit:
            raise ApiError(413, f"texts[{i}] has {len(ids)} tokens; this model reads at most {limit}")
    return sum(len(ids) + 1 for ids in encoded)


def _sampling(service: Service, served: ServedModel, body: GenerateRequest) -> Sampling:
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
    return Sampling(
        ids=list(ids),
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=list(body.stop),
    )


def add_explorer_routes(app: FastAPI, service: Service) -> None:
    explorer = service.explorer

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(await service.worker.run(explorer.page))

    @app.api_route("/index.html", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(await service.worker.run(explorer.page))

    # GET and HEAD on one route (one 405 that names both); out of the OpenAPI schema, whose operation
    # ids would repeat for the two methods
    @app.api_route("/api/models", methods=["GET", "HEAD"], include_in_schema=False)
    async def explorer_models() -> dict[str, Any]:
        """The explorer's models and its input limit."""
        return {"models": explorer.model_names, "max_chars": explorer.max_chars}

    @app.post("/api/attend")
    async def attend(request: Request) -> JSONResponse:
        """The explorer's drawing of a sentence: body ``{"text": str, "model": name}`` (with ``"target"``:
        a translation to teacher-force, or ``"compare"``: a second sentence)."""
        payload = parse_json(await request.body())
        try:
            return Utf8JSONResponse(await service.worker.run(explorer.attend, payload))
        except RequestError as err:
            raise ApiError(err.status, err.message) from None
