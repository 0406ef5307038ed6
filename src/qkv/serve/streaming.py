"""A language model's continuation as server-sent events (``text/event-stream``).

The model samples on the model thread (:class:`~qkv.serve.batching.ModelWorker`) with the generator
``qkv generate`` uses (:mod:`qkv.inference.generation`); after each token the text grown so far is
decoded, cut at the first stop text, and what is new is handed to the event loop, which sends it as
``data: {"text": "..."}``. What could still turn into a stop text, or is an incomplete UTF-8
character, is held back until it is settled. The stream ends with ``event: done``
(the whole text, the token count and why it stopped) or, if the model failed, ``event: error``.
A client that goes away stops the sampling at the next token, streamed or not (:func:`generate_text`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.inference.generation import SamplingConfig, TextStream, generate_texts
from qkv.serve.batching import ModelWorker

logger = logging.getLogger(__name__)

__all__ = ["Sampling", "TextStream", "event", "generate_text", "sample", "stream_events"]  # TextStream: re-exported


@dataclass
class Sampling:
    """One generation request, checked."""

    ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False  # also report each chosen token's log-probability (the done event's ``logprobs``)


def sample(model: Any, tokenizer: Any, request: Sampling, on_text: Any, stopped: threading.Event) -> dict[str, Any]:
    """Generate on this thread (:func:`qkv.inference.generation.generate_texts`, as ``qkv generate``
    does); ``on_text(str)`` gets each settled piece; ``stopped`` set (its client went) ends the
    sampling at the next token. Returns the final summary."""
    if stopped.is_set():
        return {"text": "", "tokens": 0, "finish_reason": "stop"}
    generator = torch.Generator(device=next(model.parameters()).device)
    if request.seed is not None:
        generator.manual_seed(request.seed)
    else:
        generator.seed()
    sampling = SamplingConfig(request.max_tokens, request.temperature, request.top_k, request.top_p, request.stop)
    (result,) = generate_texts(
        model,
        tokenizer,
        request.ids,
        sampling,
        generator=generator,
        on_text=lambda _row, text: on_text(text),
        stopped=stopped.is_set,
    )
    return {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason}


def event(data: dict[str, Any], name: str | None = None) -> str:
    """One server-sent event (JSON data on one line)."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(worker: ModelWorker, model: Any, tokenizer: Any, request: Sampling) -> AsyncIterator[str]:
    """The events of one generation; the sampling runs on the model thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stopped = threading.Event()

    def put(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def job() -> None:
        if stopped.is_set():  # the client left while this waited for the model thread
            put("end", None)
            return
        try:
            summary = sample(model, tokenizer, request, lambda text: put("text", text), stopped)
        except Exception:
            logger.exception("generation failed")
            put("error", "internal error while generating; see the server log")
        else:
            put("done", summary)

    worker.submit(job)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield event({"text": value})
            elif kind == "done":
                yield event(value, "done")
                return
            elif kind == "error":
                yield event({"error": value}, "error")
                return
            else:
                return
    finally:
        stopped.set()  # a client that went away (or an ended stream) stops the sampling at its next token


async def generate_text(
    worker: ModelWorker, model: Any, tokenizer: Any, request: Sampling, stopped: threading.Event | None = None
) -> dict[str, Any]:
    """The whole continuation at once (``"stream": false``). Cancelled, or ``stopped`` set (its client
    went), it never starts if it still waits for the model thread, and stops at its next token if it runs."""
    stopped = stopped or threading.Event()
    try:
        return await worker.run(sample, model, tokenizer, request, lambda text: None, stopped)
    finally:
        stopped.set()
