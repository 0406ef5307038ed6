"""Batched greedy decoding and beam search over :meth:`Transformer.encode` / :meth:`Transformer.decode`.

Both run the encoder once and, with ``use_cache=True`` (the default), feed the decoder one new
token a step: self-attention keys/values are appended to a :class:`~qkv.KVCache` and the
cross-attention keys/values of the encoder output are projected once, on the first step, and
reused. ``use_cache=False`` recomputes the whole prefix every step (the slow reference the tests
compare against).

Shape legend: ``b`` sentences, ``k`` beam size, ``s_src`` source length, ``t`` decoded length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from qkv.attention.multihead import KVCache
from qkv.decoding.ensemble import Ensemble
from qkv.models.transformer import DecoderOutput, EncoderOutput, Transformer


@dataclass
class Hypothesis:
    """A finished beam-search hypothesis."""

    tokens: list[int]  # decoded ids, EOS excluded
    score: float  # sum of log-probabilities (EOS included when it was produced)
    normalized: float  # score / length_penalty(len)


PenaltyForm = Literal["gnmt", "power"]
PENALTY_FORMS: tuple[str, ...] = ("gnmt", "power")


def length_penalty(length: int, alpha: float, form: PenaltyForm = "gnmt") -> float:
    """The divisor of a finished hypothesis's log-probability.

    ``"gnmt"`` (qkv's default): ``((5 + length) / 6) ** alpha`` (Wu et al. 2016, eq. 14, without its
    coverage term), which "Attention Is All You Need" used with alpha 0.6 and beam 4 (section 6.1).
    ``"power"``: ``length ** alpha``, the form of Hugging Face's ``generate`` (``length_penalty``) and
    CTranslate2 (``length_penalty``); with it qkv ranks beams as they do. Either way a finished
    hypothesis's length counts its EOS (not BOS), as tensor2tensor's beam search (the paper's),
    Hugging Face and CTranslate2 count it."""
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if form == "power":
        return float(length) ** alpha
    raise ValueError(f"length penalty form must be one of {', '.join(PENALTY_FORMS)}, got {form!r}")


def _source_mask(memory: EncoderOutput) -> Tensor:
    """``(b, s_src)`` True = real token: :meth:`Transformer.encode` always sets it."""
    assert memory.key_padding_mask is not None
    return memory.key_padding_mask


def _logits(out: DecoderOutput) -> Tensor:
    """``(b, t, V)``: :meth:`Transformer.decode` projects unless told not to."""
    assert out.logits is not None
    return out.logits


def _max_lengths(memory: EncoderOutput, extra_len: int, limit: int) -> Tensor:
    """Per-sentence decoding limit: source length + ``extra_len``, capped by the positional table."""
    src_len = _source_mask(memory).sum(dim=1)  # (b,)
    return (src_len + extra_len).clamp(max=limit)


def _reorder_cache(cache: list[tuple[KVCache, KVCache]], index: Tensor) -> list[tuple[KVCache, KVCache]]:
    # self-attention caches follow their beams; the cross-attention cache is the same for every
    # beam of a sentence and beams never change sentence, so it is left as it is.
    return [(self_cache.index_select(index), cross_cache) for self_cache, cross_cache in cache]


def _expand_memory(memory: EncoderOutput, k: int) -> EncoderOutput:
    index = torch.arange(memory.hidden.size(0), device=memory.hidden.device).repeat_interleave(k)
    return EncoderOutput(memory.hidden.index_select(0, index), None, _source_mask(memory).index_select(0, index))


@torch.no_grad()
def greedy_decode(
    model: Transformer | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    extra_len: int = 50,
    use_cache: bool = True,
) -> list[list[int]]:
    """Pick the most likely token at every step, for a whole batch at once.

    Args:
        model: a :class:`Transformer` (put in eval mode by the caller).
        src: ``(b, s_src)`` padded source ids (padding = ``model.config.pad_id``).
        bos_id: the target's start token.
        eos_id: the target's end token.
        extra_len: a sentence stops after ``source length + extra_len`` tokens without EOS.
        use_cache: decode incrementally with the KV cache (else recompute the prefix each step).

    Returns:
        one list of token ids per sentence, without BOS and EOS.
    """
    pad_id = model.config.pad_id
    memory = model.encode(src)
    b = src.size(0)
    max_len = _max_lengths(memory, extra_len, model.config.max_len - 1)  # (b,)
    tokens = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)  # (b, t)
    finished = torch.zeros(b, dtype=torch.bool, device=src.device)
    lengths = max_len.clone()
    cache = None
    for step in range(int(max_len.max())):
        out = model.decode(tokens[:, -1:] if use_cache else tokens, memory, cache=cache)
        cache = out.cache if use_cache else None
        next_token = _logits(out)[:, -1].argmax(dim=-1)  # (b,)
        next_token = next_token.masked_fill(finished, pad_id)
        just_ended = ~finished & (next_token == eos_id)
        lengths = torch.where(just_ended, torch.full_like(lengths, step), lengths)
        finished |= just_ended | (step + 1 >= max_len)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if bool(finished.all()):
            break
    return [tokens[i, 1 : 1 + int(lengths[i])].tolist() for i in range(b)]


@overload
def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 5,
    alpha: float = 0.6,
    penalty: PenaltyForm = "gnmt",
    extra_len: int = 50,
    use_cache: bool = True,
    return_all: Literal[False] = False,
) -> list[list[int]]: ...


@overload
def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 5,
    alpha: float = 0.6,
    penalty: PenaltyForm = "gnmt",
    extra_len: int = 50,
    use_cache: bool = True,
    return_all: Literal[True],
) -> list[list[Hypothesis]]: ...


@torch.no_grad()
def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 5,
    alpha: float = 0.6,
    penalty: PenaltyForm = "gnmt",
    extra_len: int = 50,
    use_cache: bool = True,
    return_all: bool = False,
) -> list[list[int]] | list[list[Hypothesis]]:
    """Beam search for a whole batch, ``beam_size`` hypotheses per sentence.

    Every step extends each live hypothesis by every token, keeps the ``2k`` best candidates per
    sentence, finalises those ending in EOS that rank within the first ``k`` and keeps the best
    ``k`` others alive. A sentence is done once it has ``k`` finished hypotheses or reaches
    ``source length + extra_len`` tokens (then its live hypotheses are finished as they are).
    The winner maximises ``log p / length_penalty(len, alpha, penalty)``.

    Args:
        model: a :class:`Transformer` in eval mode.
        src: ``(b, s_src)`` padded source ids.
        bos_id: the target's start token.
        eos_id: the target's end token.
        beam_size: ``k``; 1 gives exactly greedy decoding.
        alpha: length penalty exponent (0 = raw log-probability).
        penalty: the length penalty's form, ``"gnmt"`` or ``"power"`` (see :func:`length_penalty`).
        extra_len: length limit beyond the source length.
        use_cache: incremental decoding with the KV cache.
        return_all: return every finished hypothesis (best first) instead of the best ids.

    Returns:
        per sentence the best token ids (no BOS/EOS), or lists of :class:`Hypothesis`.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    length_penalty(1, alpha, penalty)  # an unknown form fails here, before any work
    k = beam_size
    pad_id = model.config.pad_id
    device = src.device
    memory = model.encode(src)
    b = src.size(0)
    max_len = _max_lengths(memory, extra_len, model.config.max_len - 1).tolist()
    memory = _expand_memory(memory, k)  # (b*k, s_src, d)
    tokens = torch.full((b * k, 1), bos_id, dtype=torch.long, device=device)  # (b*k, t)
    scores = _first_scores(b, k, device)  # (b*k,)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    done = [False] * b
    cache = None
    for step in range(max(max_len)):
        out = model.decode(tokens[:, -1:] if use_cache else tokens, memory, cache=cache)
        candidates = _best_candidates(scores, _logits(out)[:, -1], b, k)
        # the next step's rows: which old row each continues, its new token and its score
        following = list(range(b * k)), [pad_id] * (b * k), [float("-inf")] * (b * k)
        for i in range(b):
            if done[i]:
                continue
            done[i] = _advance_sentence(
                i,
                k,
                tokens,
                candidates[i],
                eos_id=eos_id,
                alpha=alpha,
                penalty=penalty,
                last_step=step + 1 >= max_len[i],
                finished=finished[i],
                following=following,
            )
            if done[i]:
                following[2][i * k : (i + 1) * k] = [float("-inf")] * k
        if all(done):
            break
        new_source, new_token, new_scores = following
        index = torch.tensor(new_source, device=device)
        tokens = torch.cat([tokens.index_select(0, index), torch.tensor(new_token, device=device)[:, None]], dim=1)
        scores = torch.tensor(new_scores, device=device)
        cache = _reorder_cache(out.cache, index) if use_cache and out.cache is not None else None
    results = [sorted(hyps, key=lambda h: h.normalized, reverse=True) for hyps in finished]
    if return_all:
        return results
    return [hyps[0].tokens if hyps else [] for hyps in results]


def _first_scores(b: int, k: int, device: torch.device) -> Tensor:
    """``(b*k,)`` the beams' scores before the first step: only the first beam of each sentence is
    alive (0), so the first step does not keep ``k`` copies of one hypothesis."""
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    return scores.view(-1)


def _best_candidates(scores: Tensor, logits: Tensor, b: int, k: int) -> list[list[tuple[float, int, int]]]:
    """Per sentence, its ``2k`` best extensions ``(score, beam, token)``, best first: every live
    beam's score (``scores``, ``(b*k,)``) plus the log-probability of every token (``logits``, ``(b*k, V)``)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (b*k, V)
    vocab = log_probs.size(-1)
    candidates = (scores[:, None] + log_probs).view(b, k * vocab)  # (b, k*V)
    top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)  # (b, 2k)
    top_beam, top_token = top_index // vocab, top_index % vocab
    return [list(zip(*rows)) for rows in zip(top_scores.tolist(), top_beam.tolist(), top_token.tolist())]


def _advance_sentence(
    i: int,
    k: int,
    tokens: Tensor,
    candidates: Iterable[tuple[float, int, int]],
    *,
    eos_id: int,
    alpha: float,
    penalty: PenaltyForm,
    last_step: bool,
    finished: list[Hypothesis],
    following: tuple[list[int], list[int], list[float]],
) -> bool:
    """One beam-search step of sentence ``i``, from its best candidates ``(score, beam, token)``,
    best first: one ending in EOS that ranks within the first ``k`` is finished (added to
    ``finished``); the best ``k`` others stay alive, written into rows ``i*k ...`` of
    ``following`` (the row each continues, its token, its score). Returns whether the sentence is
    done: it has ``k`` finished hypotheses, or this was its last step (``last_step``: its live
    hypotheses are then finished as they are)."""
    source, token_at, score_at = following
    alive = 0
    for rank, (score, beam, token) in enumerate(candidates):
        if score == float("-inf"):
            break
        row = i * k + beam
        if token == eos_id:
            if rank < k:
                prefix = tokens[row, 1:].tolist()
                finished.append(Hypothesis(prefix, score, score / length_penalty(len(prefix) + 1, alpha, penalty)))
            continue
        slot = i * k + alive
        source[slot], token_at[slot], score_at[slot] = row, token, score
        alive += 1
        if alive == k:
            break
    if len(finished) >= k:
        return True
    if not last_step:
        return False
    for slot in range(i * k, i * k + alive):  # out of length: the live hypotheses end here
        prefix = tokens[source[slot], 1:].tolist() + [token_at[slot]]
        finished.append(
            Hypothesis(prefix, score_at[slot], score_at[slot] / length_penalty(len(prefix), alpha, penalty))
        )
    return True
