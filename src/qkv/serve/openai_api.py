"""The OpenAI-compatible routes of ``qkv serve``, for the official ``openai`` client and the tools built on it.

Routes:
    ``GET /v1/models/{id}``         one model in OpenAI's shape (``GET /v1/models`` lists them all)
    ``POST /v1/completions``        continue a prompt: ``text_completion`` (or its chunks, streamed)
    ``POST /v1/chat/completions``   answer a conversation with a model whose folder has a chat
                                    template (:mod:`qkv.serve.chat_template`): ``chat.completion``

Both generation routes sample as ``/v1/generate`` does (the same checks, limits, queue and
:class:`~qkv.serve.generation.Generations`), so a seed gives the same text on either. Streamed, an
answer is server-sent events, ``data: {chunk}`` lines then ``data: [DONE]``. What differs from
OpenAI: one choice only (``n`` = 1), no ``echo``, and ``logprobs`` report the chosen token's
log-probability alone (``top_logprobs`` is null or empty: the alternatives are not computed).
Errors on these routes are OpenAI's ``{"error": {"message", "type", "param", "code"}}``, a field the
schema refuses answered 400 (as OpenAI does), an unknown model 404 with code ``model_not_found``.
The bodies' pydantic models and the builders of the answers' parts are in :mod:`qkv.serve.openai_schemas`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from qkv.inference.kinds import CAUSAL_LM
from qkv.models.sampling import check_sampling
from qkv.serve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from qkv.serve.errors import ApiError, is_openai_path, one_line, openai_error_response
from qkv.serve.generation import Sampling
from qkv.serve.models import ServedModel
from qkv.serve.openai_schemas import (
    CHAT,
    COMPLETION,
    MAX_STOPS,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    SampledRequest,
    final_choice,
    model_card,
    piece_choice,
    usage,
)
from qkv.serve.service import Service

logger = logging.getLogger(__name__)

STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream: the chunks as server-sent events"}
}


class OpenAIError(ApiError):
    """An error of an OpenAI route that names the request field (``param``) or a ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message)
        self.param, self.code = param, code


def _stops(service: Service, stop: str | list[str] | None) -> list[str]:
    """The request's stop texts, checked as /v1/generate checks them (at most :data:`MAX_STOPS`)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise OpenAIError(400, f"stop: {len(stops)} stop texts; at most {MAX_STOPS}", "stop")
    for i, text in enumerate(stops):
        service.check_text(text, f"stop[{i}]", blank_ok=True)
    return stops


def check_unsupported(body: SampledRequest) -> None:
    """400 naming the field for what qkv does not do: several choices, penalties, a logit bias."""
    refusals = [
        ("n", body.n not in (None, 1), "only n=1 is served (one choice per request)"),
        ("frequency_penalty", body.frequency_penalty not in (None, 0), "penalties are not supported; send 0"),
        ("presence_penalty", body.presence_penalty not in (None, 0), "penalties are not supported; send 0"),
        ("logit_bias", bool(body.logit_bias), "a logit bias is not supported"),
    ]
    if isinstance(body, CompletionRequest):
        refusals += [
            ("echo", bool(body.echo), "echo is not supported; send false"),
            ("best_of", body.best_of not in (None, 1), "only best_of=1 is served"),
            ("suffix", body.suffix is not None, "a suffix is not supported"),
        ]
    for param, refused, message in refusals:
        if refused:
            raise OpenAIError(400, f"{param}: {message}", param)


def openai_sampling(
    service: Service, body: SampledRequest, ids: list[int], max_tokens: int, *, logprobs: bool, stops: list[str]
) -> Sampling:
    """The :class:`Sampling` of an OpenAI request: its length held to the server's ``max_new_tokens``
    and its rates to :func:`qkv.models.sampling.check_sampling`'s ranges (400 naming the field)."""
    if not ids:
        raise OpenAIError(400, "the prompt gives no tokens", "prompt")
    limit = service.limits.max_new_tokens
    if max_tokens > limit:
        raise OpenAIError(400, f"max_tokens {max_tokens}; the limit is {limit}", "max_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = None if body.top_p is None or body.top_p == 1 else body.top_p  # 1 keeps every token
    try:
        check_sampling(max_tokens, temperature, body.top_k, top_p)
    except ValueError as err:  # the range qkv generate's options share, without the command-line flag
        message = re.sub(r" \(--[a-z-]+\)", "", str(err)).replace("max_new_tokens", "max_tokens")
        raise OpenAIError(400, message, message.split(" ", 1)[0]) from None
    return Sampling(ids, max_tokens, temperature, body.top_k, top_p, body.seed, stops, logprobs=logprobs)


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _finished(service: Service, served: ServedModel, sampling: Sampling) -> dict[str, Any]:
    """The done event's summary of one generation (500 if the model failed)."""
    async with contextlib.aclosing(service.generations.events(served, sampling)) as events:
        async for kind, value in events:
            if kind == "done":
                return dict(value)
            if kind == "error":
                raise ApiError(500, str(value))
    raise ApiError(500, "the generation ended without an answer")


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A rendered conversation's token ids, as transformers' ``apply_chat_template`` tokenizes it:
    without the tokens the tokenizer puts in front of a text (the template writes its own BOS)."""
    ids = list(tokenizer.encode(prompt))
    prefix = list(getattr(tokenizer, "prefix", None) or [])
    return ids[len(prefix) :] if prefix and ids[: len(prefix)] == prefix else ids


async def _stream(
    service: Service, served: ServedModel, sampling: Sampling, kind: str, head: dict[str, Any], with_usage: bool
) -> AsyncIterator[str]:
    """A streamed answer: a chunk per piece of text, the last one with the finish reason (and the
    log-probabilities), a chunk of token counts if asked, then ``[DONE]``; counted in the model's
    queue while it is sent."""
    service.queued[served.name] += 1
    try:
        if kind == CHAT:
            yield _data({**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        async with contextlib.aclosing(service.generations.events(served, sampling)) as events:
            async for event, value in events:
                if event == "text" and value:
                    yield _data({**head, "choices": [piece_choice(kind, value)]})
                elif event == "done":
                    summary = dict(value)
                    yield _data(
                        {**head, "choices": [final_choice(kind, served, summary, sampling.logprobs, delta=True)]}
                    )
                    if with_usage:
                        yield _data({**head, "choices": [], "usage": usage(len(sampling.ids), summary)})
                    break
                elif event == "error":
                    raise ApiError(500, str(value))
        yield "data: [DONE]\n\n"
    except ApiError as err:  # the answer has started: the error is the stream's last event
        yield _data({"error": {"message": one_line(err.message), "type": "server_error", "param": None, "code": None}})
    finally:
        service.queued[served.name] -= 1


def install_openai_errors(app: FastAPI) -> None:
    """Answer the errors of the OpenAI routes in OpenAI's shape (the other routes keep theirs): each
    handler :func:`qkv.serve.errors.install_error_handlers` set is wrapped, scoped by path."""
    previous = dict(app.exception_handlers)

    async def api_error(request: Request, err: Exception) -> Any:
        if not is_openai_path(request.url.path):
            return await previous[ApiError](request, err)
        assert isinstance(err, ApiError)
        param, code = (err.param, err.code) if isinstance(err, OpenAIError) else (None, None)
        if param is None and (named := re.match(r"(messages|stop|prompt|max_tokens)\b", err.message)):
            param = named.group(1)  # a check qkv's other routes share names the field first
        status = 400 if err.status in (413, 422) else err.status  # OpenAI answers 400 to a request it refuses
        return openai_error_response(status, err.message, param, code, err.headers)

    async def invalid(request: Request, err: Exception) -> Any:
        if not is_openai_path(request.url.path):
            return await previous[RequestValidationError](request, err)
        assert isinstance(err, RequestValidationError)
        first: dict[str, Any] = dict(next(iter(err.errors()), {}))
        if first.get("type") == "json_invalid":
            return openai_error_response(400, "the body is not valid JSON")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
        where = ".".join(loc) or "body"
        return openai_error_response(400, f"{where}: {first.get('msg', 'invalid')}{more}", loc[0] if loc else None)

    async def http_error(request: Request, err: Exception) -> Any:
        answer = await previous[HTTPException](request, err)
        if not is_openai_path(request.url.path):
            return answer
        message = json.loads(bytes(answer.body))["error"]
        allow = answer.headers.get("allow")
        return openai_error_response(answer.status_code, message, headers={"Allow": allow} if allow else None)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)


def load_templates(service: Service) -> dict[str, ChatTemplate | str | None]:
    """Each language model's chat template: None where its folder has none, or why it cannot be read
    (then its chat completions answer 500 saying so)."""
    templates: dict[str, ChatTemplate | str | None] = {}
    for name, served in service.models.items():
        if served.kind == CAUSAL_LM.serve_kind:
            try:
                templates[name] = load_chat_template(served.folder)
            except ValueError as err:
                logger.warning("%s: no chat completions: %s", name, err)
                templates[name] = one_line(err)
    return templates


def completion_ids(service: Service, served: ServedModel, body: CompletionRequest) -> list[int]:
    """The token ids of a completion's one prompt (400 naming ``prompt`` for several, or a text the
    server's limits or the model's vocabulary refuse)."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise OpenAIError(400, f"prompt: {len(prompts)} prompts; this server answers one per request", "prompt")
    service.check_text(prompts[0], "prompt", blank_ok=True)
    try:
        return list(served.tokenizer.encode(prompts[0]))
    except ValueError as err:  # a character the vocabulary lacks
        raise OpenAIError(400, f"prompt: {one_line(err)}", "prompt") from None


def conversation_ids(
    service: Service, served: ServedModel, template: ChatTemplate | str | None, body: ChatRequest
) -> tuple[list[int], ChatTemplate]:
    """A conversation rendered with the model's chat template and tokenized, and the template (400
    for a model without one, too many messages, a text refused or a template that refuses them)."""
    if template is None:
        raise OpenAIError(
            400,
            f"the model {served.name!r} has no chat template (no chat_template.jinja, no chat_template in its "
            f"tokenizer_config.json); continue a prompt with /v1/completions instead",
            "model",
        )
    if isinstance(template, str):
        raise ApiError(500, f"the chat template of {served.name!r} cannot be used: {template}")
    if len(body.messages) > service.limits.max_texts:
        limit = service.limits.max_texts
        raise OpenAIError(400, f"messages: {len(body.messages)} messages; the limit is {limit}", "messages")
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)
        service.check_text(content, f"messages[{i}].content", blank_ok=True)
        messages.append({"role": message.role, "content": content, **({"name": message.name} if message.name else {})})
    try:
        return chat_ids(served.tokenizer, template.render(messages)), template
    except ChatTemplateError as err:
        raise OpenAIError(400, f"messages: the model's chat template refused them: {err}", "messages") from None
    except ValueError as err:  # a character the vocabulary lacks
        raise OpenAIError(400, f"messages: {one_line(err)}", "messages") from None


async def respond(
    service: Service, request: Request, served: ServedModel, sampling: Sampling, body: SampledRequest, kind: str
) -> Any:
    """The whole answer (through the model's queue, cancelled if the client goes), or its stream."""
    name, prefix = ("text_completion", "cmpl") if kind == COMPLETION else ("chat.completion", "chatcmpl")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": name, "created": int(time.time()), "model": served.name}
    if not body.stream:
        summary = await service.answer(request, served.name, lambda: _finished(service, served, sampling))
        choice = final_choice(kind, served, summary, sampling.logprobs, delta=False)
        return {**head, "choices": [choice], "usage": usage(len(sampling.ids), summary)}
    service.admit(served.name)
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    head["object"] = name if kind == COMPLETION else "chat.completion.chunk"
    chunks = _stream(service, served, sampling, kind, head, with_usage)
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})


def add_openai_routes(app: FastAPI, service: Service) -> None:
    """Add ``GET /v1/models/{id}``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` to
    ``app`` and answer their errors in OpenAI's shape (see the module's docstring).

    Args:
        app: the application (its error handlers already installed).
        service: the models, their limits, queues and the generation requests.
    """
    install_openai_errors(app)
    templates = load_templates(service)

    def pick(name: str | None) -> ServedModel:
        if name is not None and name not in service.models:
            raise OpenAIError(404, f"the model {name[:80]!r} does not exist on this server", "model", "model_not_found")
        return service.pick(name, CAUSAL_LM.serve_kind)

    @app.get("/v1/models/{model_id}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """One model served, in OpenAI's shape."""
        if model_id not in service.models:
            raise OpenAIError(
                404, f"the model {model_id[:80]!r} does not exist on this server", "model", "model_not_found"
            )
        return model_card(model_id, service.models[model_id])

    @app.post("/v1/completions", response_model=Completion, responses=STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """Continue a prompt (OpenAI's legacy completions): a ``text_completion``, or its chunks as
        server-sent events with ``"stream": true``. ``logprobs`` (0 to 5) reports the chosen tokens'
        log-probabilities only: the alternatives (``top_logprobs``) are not computed."""
        served = pick(body.model)
        check_unsupported(body)
        ids = completion_ids(service, served, body)
        stops = _stops(service, body.stop)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        sampling = openai_sampling(service, body, ids, max_tokens, logprobs=body.logprobs is not None, stops=stops)
        return await respond(service, request, served, sampling, body, COMPLETION)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED)
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        """Answer a conversation with a language model whose folder has a chat template: a
        ``chat.completion``, or ``chat.completion.chunk`` events with ``"stream": true``. The answer
        ends at the template's end-of-sequence token (or a stop text, or the token limit)."""
        served = pick(body.model)
        check_unsupported(body)
        # a template is someone else's code: rendered off the event loop, within its limits
        ids, template = await run_in_threadpool(conversation_ids, service, served, templates.get(served.name), body)
        stops = _stops(service, body.stop)
        if template.eos_token and template.eos_token not in stops:
            stops.append(template.eos_token)  # the end of the assistant's turn
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = asked if asked is not None else service.limits.max_new_tokens
        sampling = openai_sampling(service, body, ids, max_tokens, logprobs=bool(body.logprobs), stops=stops)
        return await respond(service, request, served, sampling, body, CHAT)
