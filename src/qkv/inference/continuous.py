"""Continuous batching of a causal language model's generations: requests join a running batch at
the next step and leave it when they stop.

One :class:`ContinuousBatch` holds the members decoding together and their key/value cache. Each
:meth:`ContinuousBatch.step`

1. runs every member's last token through the model at once, each row at its own position (the
   cache's per-row :attr:`~qkv.attention.multihead.KVCache.positions`: the members joined at
   different steps, so their histories differ in length; a row's keys are right-aligned and the
   empty slots before them masked);
2. samples each member's next token with its own settings and its own random stream (a seeded
   request draws the same numbers alone as in a batch, so it gives the same text, as
   :func:`qkv.inference.generation.generate_texts` would);
3. lets the members that stopped (a stop text, their token limit, a client gone) leave: their rows
   are dropped from the cache, which shrinks to the longest history left;
4. admits the requests waiting, up to ``max_rows``: each prompt is run alone (its first token
   sampled from it) and its cache joins the batch's.

A member whose sequence fills the model's context re-reads its last ``context`` tokens each step
without a cache, as :func:`qkv.models.sampling.sample_loop` does from there on (those members
together: their inputs are all ``context`` long).

Shape legend: ``b`` members, ``V`` vocabulary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.attention.multihead import KVCache
from qkv.inference.generation import Continuation, SamplingConfig, TextStream
from qkv.models.sampling import sample_next

__all__ = ["ContinuousBatch", "GenerationRequest", "Member"]


@dataclass
class GenerationRequest:
    """One request to continue a prompt.

    Args:
        prompt: its token ids, at least one (cropped to the model's last ``context``).
        sampling: how to sample (its token limit and stop texts included).
        seed: seeds the request's own random stream; None: a fresh random seed.
        logprobs: record each chosen token's log-probability under the model.
        on_text: called with each settled piece of the text, in order (on the thread that steps).
        stopped: polled each step; True makes the member leave (its client went away).
    """

    prompt: Sequence[int]
    sampling: SamplingConfig
    seed: int | None = None
    logprobs: bool = False
    on_text: Callable[[str], None] | None = None
    stopped: Callable[[], bool] | None = None


@dataclass
class Member:
    """A request in the batch: its sequence so far, its text, its random stream and its outcome."""

    request: GenerationRequest
    stream: TextStream
    generator: torch.Generator
    ids: list[int]  # the prompt (cropped) and the tokens generated so far
    new: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    result: Continuation | None = None  # set when it leaves

    @property
    def done(self) -> bool:
        """Whether the member has left the batch (:attr:`result` holds its outcome)."""
        return self.result is not None


class ContinuousBatch:
    """The members of one model decoding together (see the module's docstring).

    Args:
        model: a :class:`~qkv.models.causal_lm.CausalLM` (in eval mode, under ``torch.no_grad``:
            the caller's business, as the model thread of ``qkv serve`` sees to).
        tokenizer: its tokenizer (``decode``).
        max_rows: the most members decoding together; more wait for a row to free.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_rows: int = 32) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.model, self.tokenizer, self.max_rows = model, tokenizer, max_rows
        self.device = next(model.parameters()).device
        self.context: int = model.config.context
        self.waiting: deque[Member] = deque()
        self.members: list[Member] = []  # the cached rows, in the cache's row order
        self.overflowing: list[Member] = []  # sequences at the context: re-read (without a cache) each step
        self.cache: list[KVCache] | None = None

    def add(self, request: GenerationRequest) -> Member:
        """Queue ``request`` to join at the next step; returns its member (``result`` once it leaves)."""
        if not request.prompt:
            raise ValueError("the prompt gives no tokens: pass a prompt with at least one token")
        generator = torch.Generator(device=self.device)
        if request.seed is not None:
            generator.manual_seed(request.seed)
        else:
            generator.seed()
        member = Member(request, TextStream(self.tokenizer, request.sampling.stop), generator, list(request.prompt))
        self.waiting.append(member)
        return member

    @property
    def rows(self) -> int:
        """The members decoding now (the waiting ones not counted)."""
        return len(self.members) + len(self.overflowing)

    def __bool__(self) -> bool:
        return bool(self.rows or self.waiting)

    @torch.no_grad()
    def step(self) -> list[Member]:
        """One step of every member, then the waiting requests admitted (each with its first token).

        Returns:
            The members that left in this step (their :attr:`Member.result` set), in no set order.
        """
        left: list[Member] = []
        if self.members:
            ids = torch.tensor([[m.ids[-1]] for m in self.members], dtype=torch.long, device=self.device)
            out = self.model(ids, cache=self.cache)
            self.cache = out.cache
            logits = out.logits[:, -1]  # (b, V)
            for row, member in enumerate(self.members):
                self._take(member, logits[row : row + 1])
            self._leave_cached(left)
        if self.overflowing:  # each re-reads its last `context` tokens: equal lengths, one batch without a cache
            tails = torch.tensor([m.ids[-self.context :] for m in self.overflowing], device=self.device)
            logits = self.model(tails).logits[:, -1]
            for row, member in enumerate(self.overflowing):
                self._take(member, logits[row : row + 1])
            left.extend(m for m in self.overflowing if m.done)
            self.overflowing = [m for m in self.overflowing if not m.done]
        while self.waiting and self.rows < self.max_rows:
            member = self.waiting.popleft()
            if member.request.stopped is not None and member.request.stopped():  # gone before its turn: never run
                member.result = Continuation("", 0, "stop")
            else:
                self._join(member)
            if member.done:
                left.append(member)
        return left

    def _tail(self, member: Member) -> Tensor:
        return torch.tensor([member.ids[-self.context :]], dtype=torch.long, device=self.device)

    def _join(self, member: Member) -> None:
        """Run the member's prompt alone, sample its first token, and add its cache to the batch's."""
        member.ids = member.ids[-self.context :]
        out = self.model(self._tail(member))
        self._take(member, out.logits[:, -1])
        if member.done:
            return
        if len(member.ids) > self.context:  # the prompt filled the context: re-read from now on
            self.overflowing.append(member)
            return
        self.members.append(member)
        joined = out.cache
        self.cache = joined if self.cache is None else [KVCache.concat_rows([a, b]) for a, b in zip(self.cache, joined)]

    def _take(self, member: Member, logits: Tensor) -> None:
        """Sample the member's next token from its logits ``(1, V)``, grow its text, and end it if it stopped."""
        request, sampling = member.request, member.request.sampling
        scores = logits.float()
        token = int(sample_next(scores, sampling.temperature, sampling.top_k, sampling.top_p, member.generator))
        member.ids.append(token)
        member.new.append(token)
        if request.logprobs:
            member.logprobs.append(float(torch.log_softmax(scores[0], dim=-1)[token]))
        piece = member.stream.add(token)
        if piece and request.on_text is not None:
            request.on_text(piece)
        stopped = request.stopped is not None and request.stopped()
        if member.stream.done or stopped or len(member.new) >= sampling.max_new_tokens:
            rest = member.stream.settled(final=True)
            if rest and request.on_text is not None:
                request.on_text(rest)
            reason = "stop" if member.stream.done else "length"
            member.result = Continuation(member.stream.text, len(member.new), reason)

    def _leave_cached(self, left: list[Member]) -> None:
        """Drop the rows of members that stopped (and move those at the context to re-reading)."""
        keep = [i for i, m in enumerate(self.members) if not m.done and len(m.ids) <= self.context]
        for member in self.members:
            if member.done:
                left.append(member)
            elif len(member.ids) > self.context:
                self.overflowing.append(member)
        if len(keep) == len(self.members):
            return
        self.members = [self.members[i] for i in keep]
        if not keep or self.cache is None:
            self.cache = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache = [layer.index_select(index).trimmed() for layer in self.cache]
