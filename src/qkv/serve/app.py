"""The FastAPI application of ``qkv serve``.

Routes:
    ``POST /v1/translate``  ``{"texts": [...], "beam_size", "alpha", "penalty", "model"}`` -> translations
                            (concurrent requests are batched dynamically: :mod:`qkv.serve.batching`)
    ``POST /v1/generate``   ``{"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                            "stream", "model"}`` -> server-sent events (:mod:`qkv.serve.streaming`; concurrent
                            requests share one decoding batch: :mod:`qkv.serve.generation`)
    ``POST /v1/embed``      ``{"texts": [...], "normalize", "model"}`` -> sentence embeddings
    ``POST /v1/completions``, ``POST /v1/chat/completions``  the OpenAI-compatible API (:mod:`qkv.serve.openai_api`)
    ``GET /v1/models``      every model, in OpenAI's shape and as name, kind and endpoint
    ``GET /metrics``        the Prometheus metrics (:mod:`qkv.serve.metrics`)
    ``GET /``, ``GET /api/models``, ``POST /api/attend``  the attention explorer (:class:`qkv.viz.app.ExplorerApp`)
    ``GET /health``         ``{"status": "ok", ...}``; ``GET /docs``: the OpenAPI documentation

Every error is ``{"error": "<one line>"}`` (:mod:`qkv.serve.errors`).
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import AsyncIterator, Collection
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from qkv import __version__
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.serve.access import AccessLog, ApiKeyGuard
from qkv.serve.batching import DecodeKey
from qkv.serve.errors import (
    ApiError,
    RequestGuard,
    Utf8JSONResponse,
    error_response,
    install_error_handlers,
    parse_json,
)
from qkv.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from qkv.serve.models import KIND_NAMES, Limits, ServedModel
from qkv.serve.openai_api import add_openai_routes
from qkv.serve.openai_schemas import model_card
from qkv.serve.schemas import (
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    TranslateRequest,
    TranslateResponse,
)
from qkv.serve.service import ClientGone, Service, check_encoder_lengths, sampling_of, source_tokens
from qkv.serve.streaming import generate_text, stream_events
from qkv.viz.app import ExplorerApp, RequestError

T = TypeVar("T")
JSON_PATHS = ("/v1/translate", "/v1/generate", "/v1/embed", "/api/attend", "/v1/completions", "/v1/chat/completions")
EXPLORER = "explorer"  # the explorer's requests are queued under this name


def create_app(
    models: dict[str, ServedModel],
    explorer: ExplorerApp,
    limits: Limits | None = None,
    *,
    allowed_hosts: Collection[str] | None = None,
    api_key: str | None = None,
    access_log: bool = True,
) -> FastAPI:
    """The application serving ``models`` (and ``explorer``, the attention explorer of the same models).

    Args:
        models: the models, by name.
        explorer: the attention explorer of the same models.
        limits: what one request may ask for (default :class:`Limits`).
        allowed_hosts: the names a request's ``Host`` may give (421 for another); None: any.
        api_key: the key every request but ``GET /health`` must send (401 without it); None: no key.
        access_log: write one JSON line per request to the logger ``qkv.serve.access``
            (:class:`~qkv.serve.access.AccessLog`; the request ids and ``/metrics`` work either way).

    Returns:
        the FastAPI application.
    """
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
        docs_url=None,  # a page of our own: Swagger UI would load its scripts from a CDN
        redoc_url=None,
    )
    app.state.service = service
    app.state.connections = None  # the server's ConnectionGuard, when it has one (/health reports it)
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone) -> JSONResponse:
        return error_response(499, "the client closed the connection")  # nobody reads it

    app.add_middleware(
        RequestGuard,
        max_bytes=service.limits.max_body_bytes,
        allowed_hosts=allowed_hosts,
        json_paths=JSON_PATHS,
        on_client_gone=service.client_gone,
    )
    if api_key is not None:  # outside the guard: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    # the outermost of the application's own: every answer is counted and logged, a refusal included
    app.add_middleware(AccessLog, metrics=service.metrics, routes=app.router.routes, log=access_log)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """The server's metrics in the Prometheus text format: requests by route and status, their
        latency, batch sizes, queue depths, tokens generated and the time to the first token."""
        return Response(service.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    add_api_routes(app, service)
    add_status_routes(app, service)
    add_openai_routes(app, service)  # /v1/completions, /v1/chat/completions (qkv.serve.openai_api)
    add_explorer_routes(app, service)
    add_docs_page(app)
    return app


def add_api_routes(app: FastAPI, service: Service) -> None:
    """Add the model endpoints to ``app``: ``POST /v1/translate`` (batched), ``POST /v1/generate``
    (server-sent events, or one JSON answer) and ``POST /v1/embed``.

    Args:
        app: the application to add the routes to.
        service: what the routes answer with: the models, their limits, queues and worker.
    """

    @app.post("/v1/translate", response_model=TranslateResponse)
    async def translate(body: TranslateRequest, request: Request) -> dict[str, Any]:
        """Translate a batch of sentences (beam search with a length penalty; beam_size 1 = greedy)."""
        served = service.pick(body.model, SEQ2SEQ.serve_kind)
        service.check_texts(body.texts)
        decode = service.decode_config(served, body)
        tokens = source_tokens(served, body.texts)
        key = DecodeKey(decode.beam_size, float(decode.alpha), decode.penalty or "gnmt")
        batcher = service.batchers[served.name]
        translations = await service.answer(request, served.name, lambda: batcher.translate(body.texts, key, tokens))
        return {"model": served.name, "translations": translations, **key._asdict()}

    @app.post(
        "/v1/generate",
        response_model=GenerateResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "the tokens as server-sent events"}},
    )
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """Continue a prompt with a language model: server-sent events (``data: {"text": ...}`` as the
        text grows, then ``event: done``), or one JSON answer with ``"stream": false``."""
        served = service.pick(body.model, CAUSAL_LM.serve_kind)
        sampling = sampling_of(service, served, body)
        if not body.stream:
            summary = await service.answer(
                request, served.name, lambda: generate_text(service.generations, served, sampling)
            )
            return {"model": served.name, **summary}
        service.admit(served.name)
        events = stream_events(service.generations, served, sampling)
        return StreamingResponse(
            _counted(service, served.name, events),
            media_type="text/event-stream",
            headers={"X-Accel-Buffering": "no"},
        )

    @app.post("/v1/embed", response_model=EmbedResponse)
    async def embed(body: EmbedRequest, request: Request) -> dict[str, Any]:
        """Mean-pooled (by default L2-normalised) sentence embeddings from an encoder, as ``qkv embed`` makes."""
        from qkv.pretrained import sentence_embeddings

        served = service.pick(body.model, "encoder")
        service.check_texts(body.texts)
        check_encoder_lengths(served, body.texts)
        vectors = await service.answer(
            request,
            served.name,
            lambda: service.worker.run(lambda: sentence_embeddings(served.model, body.texts, normalize=body.normalize)),
        )
        return {
            "model": served.name,
            "dimension": vectors.size(1),
            "normalized": body.normalize,
            "embeddings": vectors.tolist(),
        }


def add_status_routes(app: FastAPI, service: Service) -> None:
    """Add ``GET /v1/models`` (every model's name, kind and endpoint) and ``GET /health`` (the
    models, batches decoded, queues, cancelled requests and connections) to ``app``.

    Args:
        app: the application to add the routes to.
        service: the models and counters the routes report.
    """

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every model served, in OpenAI's shape (``data``: id, created, owned_by, with qkv's kind and
        endpoint), and as ``models``: each one's name, kind and endpoint."""
        return {
            "object": "list",
            "data": [model_card(name, m) for name, m in service.models.items()],
            "models": [
                {"name": name, "kind": KIND_NAMES[m.kind], "endpoint": m.endpoint} for name, m in service.models.items()
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The server is up; which models it serves, how many translation batches each has decoded,
        the requests queued now, those cancelled because their client went, and the connections."""
        guard = app.state.connections
        return {
            "status": "ok",
            "models": {name: KIND_NAMES[m.kind] for name, m in service.models.items()},
            "engines": {name: m.engine for name, m in service.models.items()},  # what decodes each
            "pid": os.getpid(),  # which worker process answered (qkv serve --workers)
            "translation_batches": {name: batcher.batches for name, batcher in service.batchers.items()},
            "queued": {name: service.queued[name] for name in [*service.models, EXPLORER]},
            "cancelled_requests": service.cancelled,
            **({"connections": guard.report()} if guard is not None else {}),
        }


async def _counted(service: Service, name: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, counted in the model's queue while they are sent."""
    service.queued[name] += 1
    try:
        async for item in events:
            yield item
    finally:
        service.queued[name] -= 1


def add_explorer_routes(app: FastAPI, service: Service) -> None:
    """Add the attention explorer's routes to ``app``: its page (``GET /`` and ``/index.html``),
    ``GET /api/models`` and ``POST /api/attend``, queued under the explorer's own name.

    Args:
        app: the application to add the routes to.
        service: holds the explorer, and the queue and worker its drawings run on.
    """
    explorer = service.explorer

    async def draw_page(request: Request) -> HTMLResponse:
        return HTMLResponse(await service.answer(request, EXPLORER, lambda: service.worker.run(explorer.page)))

    app.add_api_route("/", draw_page, methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    app.add_api_route(
        "/index.html", draw_page, methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False
    )

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
            drawing = await service.answer(request, EXPLORER, lambda: service.worker.run(explorer.attend, payload))
        except RequestError as err:
            raise ApiError(err.status, err.message) from None
        return Utf8JSONResponse(drawing)


DOCS_STYLE = (
    "body{font:15px/1.5 system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem}code{font-size:90%}"
)


def add_docs_page(app: FastAPI) -> None:
    """``GET /docs``: the API's routes, from its OpenAPI schema, on a page that loads nothing else (no
    scripts, nothing from another site); the whole schema is at ``/openapi.json``."""

    @app.api_route("/docs", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        schema = app.openapi()
        rows = []
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                summary = operation.get("description") or operation.get("summary") or ""
                rows.append(
                    f"<li><code>{html.escape(method.upper())} {html.escape(path)}</code>: {html.escape(summary)}</li>"
                )
        page = (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>{html.escape(app.title)} API</title><style>{DOCS_STYLE}</style></head><body>"
            f"<h1>{html.escape(app.title)} {html.escape(app.version)}: the API</h1>"
            f"<p>{html.escape(app.description)}</p><ul>{''.join(rows)}</ul>"
            '<p>The whole OpenAPI schema (request bodies, answers, limits): <a href="/openapi.json">/openapi.json</a>. '
            'Every error is one line of JSON, <code>{"error": "..."}</code>.</p></body></html>'
        )
        policy = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"
        return HTMLResponse(page, headers={"Content-Security-Policy": policy})
