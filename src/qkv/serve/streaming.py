"""A language model's continuation as server-sent events (``text/event-stream``).

The request decodes in its model's continuous batch on the model thread
(:mod:`qkv.serve.generation`, :mod:`qkv.inference.continuous`), sampled as ``qkv generate`` samples;
after each token the text grown so far is decoded, cut at the first stop text
(:class:`~qkv.inference.generation.TextStream`), and what is new is handed to the event loop, which
sends it as ``data: {"text": "..."}``. What could still turn into a stop text, or is an incomplete UTF-8
character, is held back until it is settled. The stream ends with ``event: done``
(the whole text, the token count and why it stopped) or, if the model failed, ``event: error``.
A client that goes away stops the sampling at the next token, streamed or not (:func:`generate_text`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from qkv.inference.generation import TextStream
from qkv.serve.generation import Generations, Sampling

if TYPE_CHECKING:
    from qkv.serve.models import ServedModel

__all__ = ["Sampling", "TextStream", "event", "generate_text", "stream_events"]  # Sampling, TextStream: re-exported


def event(data: dict[str, Any], name: str | None = None) -> str:
    """One server-sent event (JSON data on one line)."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(generations: Generations, served: ServedModel, request: Sampling) -> AsyncIterator[str]:
    """The server-sent events of one generation, continuously batched (:class:`~qkv.serve.generation.Generations`).
    Closing the iterator (a client that went away) makes the request leave its batch at the next step."""
    events = generations.events(served, request)
    try:
        async for kind, value in events:
            if kind == "text":
                yield event({"text": value})
            elif kind == "done":
                yield event({key: value[key] for key in ("text", "tokens", "finish_reason")}, "done")
            else:
                yield event({"error": value}, "error")
    finally:
        await events.aclose()


async def generate_text(generations: Generations, served: ServedModel, request: Sampling) -> dict[str, Any]:
    """The whole continuation at once (``"stream": false``): ``text``, ``tokens`` and ``finish_reason``.
    Cancelled (its client went), the request leaves its batch at the next step.

    Raises:
        RuntimeError: the model failed (the server log has the details).
    """
    events = generations.events(served, request)
    try:
        async for kind, value in events:
            if kind == "done":
                return {key: value[key] for key in ("text", "tokens", "finish_reason")}
            if kind == "error":
                raise RuntimeError(value)
    finally:
        await events.aclose()
    raise RuntimeError("the generation ended without an answer")
