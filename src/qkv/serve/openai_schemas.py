"""The request and answer shapes of qkv serve's OpenAI-compatible routes (:mod:`qkv.serve.openai_api`):
the pydantic models of the bodies (which the OpenAPI schema at ``/openapi.json`` shows) and the
builders of the answers' parts, a model card, a choice, its log-probabilities, the token counts.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qkv.serve.errors import ApiError
from qkv.serve.models import KIND_NAMES, ServedModel

MAX_STOPS = 4  # OpenAI's limit
STARTED = int(time.time())  # a model's "created" when its folder is unknown
COMPLETION, CHAT = "completion", "chat"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` sends a last chunk with the token counts."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class SampledRequest(_Body):
    """What the bodies of both generation routes share: the model, the sampling, the stream."""

    model: str | None = Field(None, description="a language model's name (default: the first one served)")
    temperature: float | None = Field(None, description="0 = greedy; default 1")
    top_p: float | None = Field(None, description="sample within the nucleus of probability p")
    top_k: int | None = Field(None, description="qkv's own: sample among the k most likely tokens")
    stop: str | list[str] | None = Field(
        None, description=f"stop before the first of these texts (at most {MAX_STOPS})"
    )
    seed: int | None = Field(None, ge=0, lt=2**63, description="the random seed (default: a fresh one)")
    stream: bool | None = Field(False, description="server-sent events of chunks, then [DONE]")
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, description="choices; only 1")
    user: str | None = Field(None, description="accepted and unused")
    frequency_penalty: float | None = Field(None, description="only 0")
    presence_penalty: float | None = Field(None, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, description="only empty")


class CompletionRequest(SampledRequest):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] = Field(description="the text to continue (a list of one text is accepted)")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most (default 16)")
    logprobs: int | None = Field(None, ge=0, le=5, description="report the chosen tokens' log-probabilities")
    echo: bool | None = Field(False, description="only false")
    best_of: int | None = Field(None, description="only 1")
    suffix: str | None = Field(None, description="not supported")


class TextPart(_Body):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(SampledRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation")
    max_tokens: int | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the server's limit")
    logprobs: bool | None = Field(False, description="report the chosen tokens' log-probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0 (alternatives are not computed)")


class Usage(BaseModel):
    """Tokens read and written."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class CompletionChoice(_Choice):
    """The one choice of a completion: its text."""

    text: str


class ChatChoice(_Choice):
    """The one choice of a chat completion: the assistant's message."""

    message: dict[str, str]


class _Answer(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage


class Completion(_Answer):
    """The answer of ``POST /v1/completions`` (not streamed)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletion(_Answer):
    """The answer of ``POST /v1/chat/completions`` (not streamed)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


def model_card(name: str, served: ServedModel) -> dict[str, Any]:
    """A model in OpenAI's shape, with qkv's ``kind`` and ``endpoint``; ``created``: its folder's time."""
    folder = served.folder
    created = int(folder.stat().st_mtime) if folder is not None and folder.exists() else STARTED
    kind = {"kind": KIND_NAMES[served.kind], "endpoint": served.endpoint}
    return {"id": name, "object": "model", "created": created, "owned_by": "qkv", **kind}


def _token_logprobs(served: ServedModel, summary: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The chosen tokens' texts and log-probabilities of a finished generation."""
    values = summary.get("logprobs")
    if values is None:
        raise ApiError(500, "the generation gave no log-probabilities")
    ids = summary.get("token_ids") or []
    return [served.tokenizer.decode([int(i)]) for i in ids], [float(v) for v in values]


def completion_logprobs(served: ServedModel, summary: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a completion: each token, its log-probability, and where its text
    starts in the completion; ``top_logprobs`` null (only the chosen token's is computed)."""
    tokens, values = _token_logprobs(served, summary)
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(served: ServedModel, summary: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a chat answer: each token, its log-probability and UTF-8 bytes."""
    tokens, values = _token_logprobs(served, summary)
    content = [
        {"token": t, "logprob": v, "bytes": list(t.encode("utf-8")), "top_logprobs": []} for t, v in zip(tokens, values)
    ]
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, summary: dict[str, Any] | None) -> dict[str, int]:
    """An answer's ``usage``: the prompt's tokens, those generated (in ``summary``, the generation's
    done event; none without it) and their sum."""
    written = int(summary["tokens"]) if summary else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": written, "total_tokens": prompt_tokens + written}


def final_choice(
    kind: str, served: ServedModel, summary: dict[str, Any], logprobs: bool, *, delta: bool
) -> dict[str, Any]:
    """The choice of a finished answer (``delta``: the last chunk of a stream, its text already sent)."""
    reason = summary["finish_reason"]
    if kind == COMPLETION:
        scores = completion_logprobs(served, summary) if logprobs else None
        return {"text": "" if delta else summary["text"], "index": 0, "logprobs": scores, "finish_reason": reason}
    said = {"delta": {}} if delta else {"message": {"role": "assistant", "content": summary["text"]}}
    return {
        "index": 0,
        **said,
        "logprobs": chat_logprobs(served, summary) if logprobs else None,
        "finish_reason": reason,
    }


def piece_choice(kind: str, text: str) -> dict[str, Any]:
    """A stream's choice carrying one new piece of text."""
    said = {"text": text} if kind == COMPLETION else {"delta": {"content": text}}
    return {**said, "index": 0, "logprobs": None, "finish_reason": None}
