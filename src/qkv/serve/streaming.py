"""A language model's continuation as server-sent events (``text/event-stream``).

The model samples on the model thread (:class:`~qkv.serve.batching.ModelWorker`); after each token
the text grown so far is decoded, cut at the first stop text, and what is new is handed to the event
loop, which sends it as ``data: {"text": "..."}``. What could still turn into a stop text, or is an
incomplete UTF-8 character, is held back until it is settled. The stream ends with ``event: done``
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

from qkv.serve.batching import ModelWorker

logger = logging.getLogger(__name__)


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


class TextStream:
    """The continuation's text as it grows: decoded from all new tokens each step (a BPE or byte-level
    token may change how the text before it reads), cut at the first stop text."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text, self.done, self.sent = "", False, 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> str:
        """Take one new token; return the text that is now settled and was not returned before."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            text, self.done = text[: min(cuts)], True
        self.text = text
        return self.settled()

    def settled(self, *, final: bool = False) -> str:
        shown = self.text
        if not (final or self.done):
            shown = shown[: max(0, len(shown) - self.hold)].rstrip("\ufffd")
        if len(shown) <= self.sent:
            return ""
        new, self.sent = shown[self.sent :], len(shown)
        return new


def sample(model: Any, tokenizer: Any, request: Sampling, on_text: Any, stopped: threading.Event) -> dict[str, Any]:
    """Generate on this thread; ``on_text(str)`` gets each settled piece; ``stopped`` set (its client
    went) ends the sampling at the next token. Returns the final summary."""
    if stopped.is_set():
        return {"text": "", "tokens": 0, "finish_reason": "stop"}
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if request.seed is not None:
        generator.manual_seed(request.seed)
    else:
        generator.seed()
    context = model.config.context
    ids = torch.tensor([request.ids[-context:]], dtype=torch.long, device=device)
    stream = TextStream(tokenizer, request.stop)

    def step(new: torch.Tensor) -> bool:
        piece = stream.add(int(new[0]))
        if piece:
            on_text(piece)
        return stream.done or stopped.is_set()

    model.generate(
        ids,
        request.max_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        generator=generator,
        on_step=step,
    )
    rest = stream.settled(final=True)
    if rest:
        on_text(rest)
    reason = "stop" if stream.done else "length"
    return {"text": stream.text, "tokens": len(stream.ids), "finish_reason": reason}


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
