"""Generation requests of ``qkv serve``, continuously batched: what ``/v1/generate`` and the
OpenAI-compatible routes read.

Each language model has one :class:`~qkv.inference.continuous.ContinuousBatch`. A request joins it
at the next step; each step is one job on the model thread, and after it the next step is queued
behind whatever else waits for the thread (a translation batch, an explorer drawing), so generation
never holds the thread for more than a step. The batch stops stepping when it has no members left.

:meth:`Generations.events` yields ``("text", piece)`` for each settled piece of the continuation,
then ``("done", summary)`` (``text``, ``tokens``, ``finish_reason``, ``token_ids`` and, when the
request asked for them, ``logprobs``: the chosen tokens' log-probabilities under the model), or
``("error", message)`` if the model failed. Closing the iterator (a client that went away) makes the
request leave the batch at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.inference.continuous import ContinuousBatch, GenerationRequest, Member
from qkv.inference.generation import SamplingConfig
from qkv.serve.batching import ModelWorker
from qkv.serve.models import ServedModel

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
    logprobs: bool = False  # also report each chosen token's log-probability (the done event's ``logprobs``)


GenerationEvent = tuple[str, Any]  # ("text", str) | ("done", dict) | ("error", str)
FAILED = "internal error while generating; see the server log"


class _Model:
    """One model's batch, the requests waiting to join it, and whether a step is queued."""

    def __init__(self, served: ServedModel, max_rows: int) -> None:
        self.served = served
        self.batch = ContinuousBatch(served.model, served.tokenizer, max_rows=max_rows)
        self.lock = threading.Lock()  # guards `arrived` and `stepping` (the event loop adds, the thread takes)
        self.arrived: list[tuple[GenerationRequest, Any]] = []
        self.stepping = False
        self.replies: dict[int, Any] = {}  # id(member) -> its reply function


class Generations:
    """The generation requests of every language model served, continuously batched on the model thread.

    Args:
        worker: the model thread.
        max_rows: the most requests of one model decoded together (1: one at a time, in arrival order).
        metrics: the server's metrics (``observe_batch(kind, rows)``, ``add_tokens(model, n)``,
            ``time_to_first_token(model, seconds)``), or None.
    """

    def __init__(self, worker: ModelWorker, *, max_rows: int = 32, metrics: Any = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.worker, self.max_rows, self.metrics = worker, max_rows, metrics
        self._models: dict[str, _Model] = {}
        self.steps = 0  # steps run so far, all models
        self.widest = 0  # the most requests decoding together after a step so far (the tests read it)

    def _model(self, served: ServedModel) -> _Model:
        model = self._models.get(served.name)
        if model is None:
            served.model.eval()
            model = self._models[served.name] = _Model(served, self.max_rows)
        return model

    async def events(self, served: ServedModel, request: Sampling) -> AsyncGenerator[GenerationEvent, None]:
        """The events of one generation request (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        stopped = threading.Event()
        arrived = time.perf_counter()
        first: list[float] = []

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def on_text(piece: str) -> None:
            if not first and self.metrics is not None:
                first.append(time.perf_counter())
                self.metrics.time_to_first_token(served.name, first[0] - arrived)
            put("text", piece)

        sampling = SamplingConfig(request.max_tokens, request.temperature, request.top_k, request.top_p, request.stop)
        job = GenerationRequest(
            request.ids, sampling, seed=request.seed, logprobs=request.logprobs, on_text=on_text, stopped=stopped.is_set
        )
        self._submit(self._model(served), job, put)
        try:
            while True:
                kind, value = await queue.get()
                yield kind, value
                if kind in ("done", "error"):
                    return
        finally:
            stopped.set()  # a client that went away (or an ended stream): the member leaves at its next step

    def _submit(self, model: _Model, job: GenerationRequest, reply: Any) -> None:
        with model.lock:
            model.arrived.append((job, reply))
            start = not model.stepping
            model.stepping = True
        if start:
            self.worker.submit(self._step, model)

    def _step(self, model: _Model) -> None:
        """On the model thread: admit the arrivals, run one step, answer those that left, queue the next."""
        batch = model.batch
        with model.lock:
            arrived, model.arrived = model.arrived, []
        for job, reply in arrived:
            member = batch.add(job)
            model.replies[id(member)] = reply
        try:
            with torch.inference_mode():
                before = {id(m): len(m.new) for m in [*batch.members, *batch.overflowing]}
                left = batch.step()
            self.steps += 1
            self.widest = max(self.widest, batch.rows)
            self._count(model, before, left)
            for member in left:
                self._answer(model, member)
        except Exception:
            logger.exception("generation failed")
            self._fail(model)
        with model.lock:
            more = bool(batch) or bool(model.arrived)
            model.stepping = more
        if more:
            self.worker.submit(self._step, model)

    def _count(self, model: _Model, before: dict[int, int], left: list[Member]) -> None:
        """Report the step to the metrics: the rows it decoded (joiners included) and their tokens."""
        if self.metrics is None:
            return
        made = [len(m.new) - before.get(id(m), 0) for m in [*model.batch.members, *model.batch.overflowing, *left]]
        self.metrics.observe_batch("generate", sum(1 for n in made if n > 0))
        self.metrics.add_tokens(model.served.name, sum(made))

    def _answer(self, model: _Model, member: Member) -> None:
        reply = model.replies.pop(id(member))
        result = member.result
        assert result is not None
        summary = {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason}
        logprobs = member.logprobs if member.request.logprobs else None
        reply("done", {**summary, "token_ids": list(member.new), "logprobs": logprobs})

    def _fail(self, model: _Model) -> None:
        """The model failed in a step: every member and waiting request gets the error; a fresh batch."""
        for reply in model.replies.values():
            reply("error", FAILED)
        model.replies.clear()
        served = model.served
        model.batch = ContinuousBatch(served.model, served.tokenizer, max_rows=self.max_rows)

    def report(self) -> dict[str, int]:
        """Each model's requests decoding now (for ``/health``)."""
        return {name: model.batch.rows for name, model in self._models.items()}
