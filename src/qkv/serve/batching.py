"""The model thread and the dynamic batcher of translation requests.

Every forward pass of the server runs on one worker thread (:class:`ModelWorker`): the event loop
stays free to accept connections and read requests while a model runs, and no two forward passes
share a model at once (the explorer records attention with hooks on the very modules the
translator uses).

:class:`TranslationBatcher` gathers translation requests: the first request of a batch waits up to
``max_wait_s`` for others; requests that ask for the same decoding (beam size, length penalty and
its form) join it while its source tokens, times the beam size, stay within ``max_tokens``; the batch
is decoded at once and each request gets its own sentences back. Requests that ask for another
decoding wait for a batch of their own. A request whose client went (its coroutine cancelled) leaves
its batch unread if the batch has not started decoding. With ``max_wait_s = 0`` there is no batching: each request
is decoded alone, in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from qkv.decoding.search import PenaltyForm

if TYPE_CHECKING:
    from qkv.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ModelWorker:
    """One thread that runs every model call, in the order they are submitted."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkv-model")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the model thread; the caller's coroutine waits without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    def submit(self, fn: Callable[..., T], *args: object) -> None:
        """``fn(*args)`` on the model thread, without waiting for it (a generation streams its own output)."""
        self._pool.submit(fn, *args)

    def close(self) -> None:
        """Stop the model thread: calls not yet started are cancelled, the one running is not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class DecodeKey(NamedTuple):
    """How a request asks to be decoded; only requests with equal keys share a batch."""

    beam_size: int
    alpha: float
    penalty: PenaltyForm


@dataclass
class _Job:
    texts: list[str]
    tokens: int  # source tokens (with EOS) of all its texts
    key: DecodeKey
    arrived: float
    future: asyncio.Future[list[str]]
    gone: bool = False  # its client went: the model thread skips its texts


Decoder = Callable[[list[str], DecodeKey], list[str]]


class TranslationBatcher:
    """Dynamic batching of translation requests for one model.

    Args:
        decode: ``(texts, key) -> translations`` (runs on the model thread).
        worker: the model thread.
        max_wait_s: how long a batch's first request waits for others (0: no batching).
        max_tokens: the source tokens, times the beam size, one batch may hold (one request is never
            split: a request over the budget is a batch of its own).
        metrics: where each batch's size (its sentences) is recorded, or None.
    """

    def __init__(
        self,
        decode: Decoder,
        worker: ModelWorker,
        *,
        max_wait_s: float,
        max_tokens: int,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.decode = decode
        self.metrics = metrics
        self.worker = worker
        self.max_wait_s = max_wait_s
        self.max_tokens = max_tokens
        self.batches = 0  # decoded so far (a count the tests and the load test read)
        self.skipped = 0  # requests dropped from their batch, unread, because their client went
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[_Job] = []
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def translate(self, texts: list[str], key: DecodeKey, tokens: int) -> list[str]:
        """The translations of ``texts`` (``tokens``: their source tokens), decoded with ``key``."""
        if self.max_wait_s <= 0:
            self.batches += 1
            self._record(len(texts))
            return await self.worker.run(self.decode, texts, key)
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._task is None or self._task.done():
            self._start(loop)
        assert self._arrived is not None
        future: asyncio.Future[list[str]] = loop.create_future()
        job = _Job(texts, tokens, key, loop.time(), future)
        self._pending.append(job)
        self._arrived.set()
        try:
            return await future
        except asyncio.CancelledError:  # the client went: not decoded if its batch has not started
            job.gone = True
            raise

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The collecting task on this event loop (a test client may run one loop per request)."""
        self._loop = loop
        self._pending = [job for job in self._pending if not job.future.done() and job.future.get_loop() is loop]
        self._arrived = asyncio.Event()
        self._task = loop.create_task(self._collect())

    async def _collect(self) -> None:
        assert self._arrived is not None and self._loop is not None
        while True:
            if not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            first = self._pending[0]
            while (left := first.arrived + self.max_wait_s - self._loop.time()) > 0 and not self._full(first.key):
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take(first.key)
            try:
                await self._run(batch)
            except asyncio.CancelledError:
                for job in batch:
                    job.future.cancel()
                raise

    def _full(self, key: DecodeKey) -> bool:
        return sum(job.tokens for job in self._pending if job.key == key) * key.beam_size >= self.max_tokens

    def _take(self, key: DecodeKey) -> list[_Job]:
        """The pending jobs with ``key``, in arrival order, while they fit the budget (the first always)."""
        batch: list[_Job] = []
        tokens = 0
        rest: list[_Job] = []
        for job in self._pending:
            if job.future.done():  # its client went away
                continue
            fits = not batch or (tokens + job.tokens) * key.beam_size <= self.max_tokens
            if job.key == key and fits:
                batch.append(job)
                tokens += job.tokens
            else:
                rest.append(job)
        self._pending = rest
        return batch

    async def _run(self, batch: list[_Job]) -> None:
        if not batch:
            return
        try:
            results = await self.worker.run(self._decode_wanted, batch)
        except Exception as err:  # the model failed: every request of the batch gets the error
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        for job, result in zip(batch, results):
            if result is not None and not job.future.done():
                job.future.set_result(result)

    def _decode_wanted(self, batch: list[_Job]) -> list[list[str] | None]:
        """On the model thread: decode the texts of the jobs whose clients still wait (a batch may
        have waited for the thread behind other work); None for each job whose client went."""
        wanted = [job for job in batch if not job.gone]
        self.skipped += len(batch) - len(wanted)
        if not wanted:
            return [None] * len(batch)
        self.batches += 1
        self._record(sum(len(job.texts) for job in wanted))
        translations = iter(self.decode([text for job in wanted for text in job.texts], batch[0].key))
        kept = {id(job) for job in wanted}
        return [[next(translations) for _ in job.texts] if id(job) in kept else None for job in batch]

    def _record(self, rows: int) -> None:
        """Record a batch of ``rows`` sentences in the metrics (when there are any)."""
        if self.metrics is not None and rows > 0:
            self.metrics.observe_batch("translate", rows)
