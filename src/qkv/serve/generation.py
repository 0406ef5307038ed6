"""Generation requests of ``qkv serve``, as events: what ``/v1/generate`` and the OpenAI-compatible
routes read.

:meth:`Generations.events` yields ``("text", piece)`` for each settled piece of the continuation,
then ``("done", summary)`` (``text``, ``tokens``, ``finish_reason``, ``token_ids`` and, when the
request asked for them, ``logprobs``: the chosen tokens' log-probabilities under the model), or
``("error", message)`` if the model failed. Closing the iterator (a client that went away) stops
the request's sampling at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from qkv.serve.batching import ModelWorker
from qkv.serve.models import ServedModel
from qkv.serve.streaming import Sampling, sample

logger = logging.getLogger(__name__)

GenerationEvent = tuple[str, Any]  # ("text", str) | ("done", dict) | ("error", str)


class Generations:
    """The generation requests of every language model served, on the model thread.

    Args:
        worker: the model thread.
        max_rows: the most requests decoded together in one batch (1: one at a time).
        metrics: the server's metrics (``observe_batch(kind, rows)``, ``add_tokens(model, n)``,
            ``time_to_first_token(model, seconds)``), or None.
    """

    def __init__(self, worker: ModelWorker, *, max_rows: int = 32, metrics: Any = None) -> None:
        self.worker, self.max_rows, self.metrics = worker, max_rows, metrics

    async def events(self, served: ServedModel, request: Sampling) -> AsyncIterator[GenerationEvent]:
        """The events of one generation request (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        stopped = threading.Event()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def job() -> None:
            if stopped.is_set():
                put("end", None)
                return
            try:
                summary = sample(served.model, served.tokenizer, request, lambda text: put("text", text), stopped)
            except Exception:
                logger.exception("generation failed")
                put("error", "internal error while generating; see the server log")
            else:
                put("done", {**summary, "token_ids": [], "logprobs": None})

        self.worker.submit(job)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "end":
                    return
                yield kind, value
                if kind in ("done", "error"):
                    return
        finally:
            stopped.set()
