"""Sampling a causal language model's continuation: the options' ranges, one token per row, the loop.

Beam search is :mod:`qkv.decoding.search`; this is its sampling counterpart, written once and used by
:meth:`qkv.models.causal_lm.CausalLM.generate` and, through it, by :mod:`qkv.inference.generation`
(``qkv generate`` and ``qkv serve``). It sits with the models, below decoding, because the model's
own ``generate`` calls it.

Shape legend: ``b`` batch, ``s`` sequence, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

# The sampling options' ranges, shared by ``qkv generate`` and ``qkv serve``'s request bodies. A
# temperature below MIN_TEMPERATURE (other than 0, greedy) or a top-p below MIN_TOP_P rounds to 0 in
# float32 (1e-300 does) and turns the softmax into NaN; a temperature above MAX_TEMPERATURE flattens
# any vocabulary qkv holds to uniform noise, and Infinity divides every logit to 0 or NaN.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6

__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P", "check_sampling", "sample_loop", "sample_next"]


class Steppable(Protocol):
    """What the loop needs of a model: its context length and a forward pass with a key/value cache."""

    @property
    def config(self) -> Any:
        """The model's config: its ``context`` is the longest sequence the model attends over."""
        ...

    def __call__(self, ids: Tensor, *, cache: Any = None) -> Any: ...  # ``.logits (b, s, V)``, ``.cache``


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The sampling options' ranges.

    Args:
        max_new_tokens: tokens to generate, at least 1.
        temperature: 0 (greedy) or from :data:`MIN_TEMPERATURE` to :data:`MAX_TEMPERATURE`.
        top_k: None or an integer >= 1.
        top_p: None or from :data:`MIN_TOP_P` to 1.

    Raises:
        ValueError: naming the option and its command-line flag.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens (--max-new-tokens) must be an integer >= 1, got {max_new_tokens!r}")
    if not (
        isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)
    ):
        raise ValueError(
            f"temperature (--temperature) must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
            f"{MAX_TEMPERATURE:g}, got {temperature!r}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k (--top-k) must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and MIN_TOP_P <= top_p <= 1):
        raise ValueError(f"top_p (--top-p) must be between {MIN_TOP_P:g} and 1, got {top_p!r}")


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row of ``logits (b, V)``: the most likely one when ``temperature`` is 0, else a
    sample from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
    and then to the smallest most-likely set whose probability reaches ``top_p`` (the nucleus).

    Args:
        logits: ``(b, V)`` next-token scores.
        temperature: divides the logits; 0 picks the most likely token.
        top_k: keep only the ``top_k`` most likely tokens.
        top_p: keep only the nucleus of probability ``top_p``.
        generator: the random stream.

    Returns:
        ``(b,)`` int64.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    # shifted so each row's maximum is 0 before dividing: a tiny temperature (1e-40) would otherwise
    # overflow the logits to inf, and inf - inf = nan in the softmax
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (b, 1) the k-th largest
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each
        drop_sorted = before >= top_p  # the most likely token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return draw(probs, generator)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of ``probs (b, V)``, index ``i`` with probability ``probs[:, i]``: one uniform
    number a row, placed in the rows' running sums (inverse transform sampling). The same law as
    ``torch.multinomial(probs, 1)``, which on a CPU takes many times longer over a 50k vocabulary
    (a large share of a batched GPT-2-sized decoding step).

    Returns:
        ``(b,)`` int64; never an index of probability 0.
    """
    running = probs.float().cumsum(dim=-1)  # (b, V)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device) * running[:, -1:]
    index = torch.searchsorted(running, u, right=True).squeeze(-1)  # the first sum above u: probability > 0
    past = index >= probs.size(-1)  # u rounded up to the total: the last token of positive probability
    if bool(past.any()):
        last = probs.size(-1) - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        index = torch.where(past, last, index)
    return index


@torch.no_grad()
def sample_loop(
    model: Steppable,
    ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    on_step: Callable[[Tensor], bool | None] | None = None,
) -> Tensor:
    """Continue every row of ``ids (b, s)`` by up to ``max_new_tokens`` sampled tokens (the model in
    eval mode is the caller's business; :meth:`~qkv.models.causal_lm.CausalLM.generate` sees to it).

    The model sees at most its last ``context`` tokens. With ``use_cache`` each step runs only the
    new token, reusing the earlier keys and values, until the sequence fills the context; from there
    on every step re-reads the last ``context`` tokens (their positions moved), which is what
    ``use_cache=False`` does at every step, so both give the same tokens.

    Args:
        model: a causal language model (:class:`Steppable`).
        ids: ``(b, s)`` the prompts, at least one token each.
        max_new_tokens: the most tokens to add.
        temperature, top_k, top_p, generator: as :func:`sample_next` takes them.
        use_cache: reuse the keys and values of earlier tokens.
        on_step: called with the new tokens ``(b,)`` after each step; returning True stops.

    Returns:
        ``(b, s + n)``: the prompt and the ``n <= max_new_tokens`` new tokens.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if ids.dim() != 2 or ids.size(1) < 1:
        raise ValueError(f"ids must be (batch, seq) with at least one token, got shape {tuple(ids.shape)}")
    context, cache, out = model.config.context, None, ids
    for _ in range(max_new_tokens):
        if use_cache and cache is not None and len(cache[0]) < context:
            step = model(out[:, -1:], cache=cache)
        else:  # the first step, no cache, or a full context: read the last `context` tokens
            step = model(out[:, -context:])
        cache = step.cache if use_cache else None
        new = sample_next(step.logits[:, -1].float(), temperature, top_k, top_p, generator)  # (b,)
        out = torch.cat([out, new[:, None]], dim=1)
        if on_step is not None and on_step(new):
            break
    return out
