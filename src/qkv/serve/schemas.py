"""The request bodies of ``/v1/translate``, ``/v1/generate`` and ``/v1/embed`` (strict types, no
unknown fields: a wrong type or an unknown field is a 422). The server's own limits (how many texts,
how long) depend on its options and are checked by the routes (413)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TranslateRequest(_Body):
    """The body of ``POST /v1/translate``: the sentences, and optionally the model and how to decode them."""

    texts: list[str] = Field(description="the sentences to translate", min_length=1)
    model: str | None = Field(None, description="a translation model's name (default: the first one served)")
    beam_size: int | None = Field(None, ge=1, description="1 = greedy; default: the run's recipe's")
    alpha: float | None = Field(None, ge=0, le=10, description="the length penalty's exponent; default: the recipe's")
    penalty: Literal["gnmt", "power"] | None = Field(
        None,
        description="the length penalty's form: ((5+len)/6)**alpha ('gnmt') or len**alpha ('power'); default: "
        "the run's saved form (gnmt for a run saved without one)",
    )


class TranslateResponse(BaseModel):
    """The answer of ``POST /v1/translate``: the model that translated, one translation per sentence
    in order, and the beam size, length penalty exponent and form it decoded with."""

    model: str
    translations: list[str]
    beam_size: int
    alpha: float
    penalty: str


class GenerateRequest(_Body):
    """The body of ``POST /v1/generate``: the prompt, and optionally the model, how to sample and
    whether to stream."""

    prompt: str = Field(description="the text to continue", min_length=1)
    model: str | None = Field(None, description="a language model's name (default: the first one served)")
    max_tokens: int | None = Field(
        None, ge=1, description="tokens to generate at most (default 128, or the server's limit)"
    )
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_k: int | None = Field(None, ge=1, description="sample among the k most likely tokens")
    top_p: float | None = Field(None, gt=0, le=1, description="sample within the nucleus of probability p")
    seed: int | None = Field(None, ge=0, lt=2**63, description="the random seed (default: a fresh one)")
    stop: list[str] = Field(default_factory=list, max_length=8, description="stop at the first of these texts")
    stream: bool = Field(True, description="server-sent events (default) or one JSON answer")


class GenerateResponse(BaseModel):
    """The answer of ``POST /v1/generate`` with ``"stream": false``: the model, the continuation, the
    tokens it took, and why it ended: at a stop text (``"stop"``) or at the token limit (``"length"``)."""

    model: str
    text: str
    tokens: int
    finish_reason: Literal["stop", "length"]


class EmbedRequest(_Body):
    """The body of ``POST /v1/embed``: the sentences, and optionally the encoder and whether to
    normalise the vectors."""

    texts: list[str] = Field(description="the sentences to embed", min_length=1)
    model: str | None = Field(None, description="an encoder's name (default: the first one served)")
    normalize: bool = Field(True, description="L2-normalise each mean-pooled vector")


class EmbedResponse(BaseModel):
    """The answer of ``POST /v1/embed``: the encoder, the vectors' dimension, whether they are
    L2-normalised, and one embedding per sentence, in order."""

    model: str
    dimension: int
    normalized: bool
    embeddings: list[list[float]]
