"""One generator for a causal language model: sampling, stop texts and the text as it grows.

``qkv generate`` (several samples, the first streamed to the terminal) and ``qkv serve``'s
``/v1/generate`` (one sample, streamed as server-sent events) both call :func:`generate_texts`; the
sampling is :meth:`qkv.models.causal_lm.CausalLM.generate` (:mod:`qkv.models.sampling`) and the stop
texts are cut by :class:`TextStream`, written once here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.models.sampling import check_sampling

__all__ = ["Continuation", "SamplingConfig", "TextStream", "generate_texts"]


@dataclass(frozen=True)
class SamplingConfig:
    """How one generation samples; checked when made (:func:`qkv.models.sampling.check_sampling`).

    Args:
        max_new_tokens: the most tokens to generate.
        temperature: 0 = greedy, else the softmax's temperature.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: sample within the nucleus of probability ``top_p``.
        stop: texts that end a sample where they first appear (not part of its text).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("--stop needs a non-empty text")


@dataclass
class Continuation:
    """One sample's outcome: its text (cut before a stop text), the tokens it took (the one that
    completed a stop text included) and why it ended (``"stop"`` or ``"length"``)."""

    text: str
    tokens: int
    finish_reason: str


class TextStream:
    """The continuation's text as it grows: decoded from all new tokens each step (a BPE or byte-level
    token may change how the text before it reads), cut at the first stop text. What could still turn
    into a stop text, or is an incomplete UTF-8 character, is held back until it is settled.

    Args:
        tokenizer: anything with ``decode(ids) -> str``.
        stop: the stop texts.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.text, self.done, self.sent = "", False, 0
        self.hold = max((len(s) for s in self.stop), default=1) - 1

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
        """The settled text not returned before (with ``final``, all of it: nothing more comes)."""
        shown = self.text
        if not (final or self.done):
            shown = shown[: max(0, len(shown) - self.hold)].rstrip("\ufffd")
        if len(shown) <= self.sent:
            return ""
        new, self.sent = shown[self.sent :], len(shown)
        return new


def generate_texts(
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    sampling: SamplingConfig,
    *,
    samples: int = 1,
    generator: torch.Generator | None = None,
    on_text: Callable[[int, str], None] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> list[Continuation]:
    """Continue ``prompt`` ``samples`` times, together in one batch.

    Args:
        model: a :class:`~qkv.models.causal_lm.CausalLM` (or anything with its ``generate`` and
            ``config.context``); the prompt is cropped to its last ``context`` tokens.
        tokenizer: its tokenizer (``decode``).
        prompt: the prompt's token ids, at least one.
        sampling: how to sample.
        samples: how many continuations.
        generator: the random stream (None: torch's global one).
        on_text: called with ``(sample index, text)`` for each piece of a sample's text once it is
            settled, in order; the pieces of one sample add up to its :attr:`Continuation.text`.
        stopped: polled after each token; True ends every sample there (a client that went away).

    Returns:
        One :class:`Continuation` per sample.
    """
    if not prompt:
        raise ValueError("the prompt gives no tokens: pass a prompt with at least one token")
    device = next(model.parameters()).device
    context = model.config.context
    batch = torch.tensor([list(prompt[-context:])] * samples, dtype=torch.long, device=device)
    streams = [TextStream(tokenizer, sampling.stop) for _ in range(samples)]

    def step(new: torch.Tensor) -> bool:
        for row, token in enumerate(new.tolist()):
            stream = streams[row]
            if stream.done:
                continue
            piece = stream.add(token)
            if piece and on_text is not None:
                on_text(row, piece)
        return all(s.done for s in streams) or (stopped is not None and stopped())

    model.generate(
        batch,
        sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        generator=generator,
        on_step=step,
    )
    for row, stream in enumerate(streams):
        rest = stream.settled(final=True)
        if rest and on_text is not None:
            on_text(row, rest)
    return [Continuation(s.text, len(s.ids), "stop" if s.done else "length") for s in streams]
