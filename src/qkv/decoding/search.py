"""Batched greedy decoding and beam search over :meth:`Transformer.encode` / :meth:`Transformer.decode`.

Both run the encoder once and, with ``use_cache=True`` (the default), feed the decoder one new
token a step: self-attention keys/values are appended to a :class:`~qkv.KVCache` and the
cross-attention keys/values of the encoder output are projected once, on the first step, and
reused. ``use_cache=False`` recomputes the whole prefix every step (the slow reference the tests
compare against). The steps themselves are :mod:`qkv.decoding.steps`'s. Both take a model or an
:class:`~qkv.decoding.inference.InferenceModel` (the model's layers over packed weights, built by the
caller and kept across calls); given a plain float32 Transformer on the CPU, they build one for the call.

A sentence that is done (EOS, or its length limit; in beam search ``k`` finished hypotheses) leaves
the batch: later steps decode only the rows still searching, as CTranslate2 does. Rows are
independent in every layer, so this changes what is computed, not what it means; a matrix product's
last bits can depend on how many rows it has (MKL on a few rows), as they already did between batches
of different sizes, and the 1000 sentences of Multi30k test 2016 translate to the same strings as
before (docs/deploy.md, "Decoding speed").

Shape legend: ``b`` sentences, ``k`` beam size, ``s_src`` source length, ``t`` decoded length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from qkv.decoding.steps import Decodable, decoder_steps, encode, for_decoding
from qkv.models.transformer import EncoderOutput


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


def _max_lengths(memory: EncoderOutput, extra_len: int, limit: int) -> Tensor:
    """Per-sentence decoding limit: source length + ``extra_len``, capped by the positional table."""
    src_len = _source_mask(memory).sum(dim=1)  # (b,)
    return (src_len + extra_len).clamp(max=limit)


ARGMAX_BLOCK = 32  # argmax_rows's block: the vocabulary is searched in blocks of this many ids


def argmax_rows(x: Tensor) -> Tensor:
    """``x (b, V)`` -> ``(b,)``: each row's index of its first largest value, what ``x.argmax(-1)`` gives.

    PyTorch's argmax over a long last dimension is a scalar loop on the CPU (about 0.14 ms for 16 rows of
    an 8,000-token vocabulary on the 2-core AVX2 EPYC, ten times ``amax``'s time), and greedy decoding
    takes one every step. Here a row is cut into blocks of :data:`ARGMAX_BLOCK` ids: the block maxima
    (``amax``, vectorised), the first block holding the row's maximum (argmax over ``V / 32`` values), and
    the first maximum inside that block. The result is the same index, ties included (the first block
    with the maximum holds its first occurrence); a vocabulary the block does not divide, another dtype
    or a NaN row takes ``x.argmax(-1)``."""
    b, v = x.shape
    if v % ARGMAX_BLOCK or v < 4 * ARGMAX_BLOCK or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    blocks = x.view(b, v // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_max = blocks.amax(dim=-1)  # (b, V/32)
    if bool(block_max.isnan().any()):  # argmax's NaN rule (a NaN is the maximum) is kept by argmax itself
        return x.argmax(dim=-1)
    best = block_max.argmax(dim=-1)  # (b,) the first block holding the row's maximum
    inside = blocks[torch.arange(b, device=x.device), best].argmax(dim=-1)  # (b,)
    return best * ARGMAX_BLOCK + inside


@torch.inference_mode()
def greedy_decode(
    model: Decodable,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    extra_len: int = 50,
    use_cache: bool = True,
) -> list[list[int]]:
    """Pick the most likely token at every step, for a whole batch at once.

    Args:
        model: a :class:`Transformer` (put in eval mode by the caller), an :class:`Ensemble` or an
            :class:`~qkv.decoding.inference.InferenceModel`.
        src: ``(b, s_src)`` padded source ids (padding = ``model.config.pad_id``).
        bos_id: the target's start token.
        eos_id: the target's end token.
        extra_len: a sentence stops after ``source length + extra_len`` tokens without EOS.
        use_cache: decode incrementally with the KV cache (else recompute the prefix each step).

    Returns:
        one list of token ids per sentence, without BOS and EOS.
    """
    model = for_decoding(model, use_cache)
    memory = encode(model, src)
    b = src.size(0)
    max_len = _max_lengths(memory, extra_len, model.config.max_len - 1)  # (b,)
    tokens = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)  # (b', t)
    sentence = torch.arange(b, device=src.device)  # (b',) the sentence each row decodes
    results: list[list[int]] = [[] for _ in range(b)]
    steps = decoder_steps(model, memory, use_cache)
    for step in range(int(max_len.max()) if b else 0):
        next_token = argmax_rows(steps(tokens))  # (b',)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        at_eos = next_token == eos_id
        ended = at_eos | (step + 1 >= max_len)
        if not bool(ended.any()):
            continue
        # a sentence that ended leaves the batch: its ids (EOS dropped) are kept, its row is not decoded again
        rows = ended.nonzero()[:, 0]
        for row, i, with_eos, limit in zip(*(t.tolist() for t in (rows, sentence[rows], at_eos[rows], max_len[rows]))):
            results[i] = tokens[row, 1 : 1 + (step if with_eos else min(step + 1, limit))].tolist()
        keep = (~ended).nonzero()[:, 0]
        if keep.numel() == 0:
            break
        tokens, sentence, max_len = tokens[keep], sentence[keep], max_len[keep]
        steps.select(keep, keep)
    return results


@overload
def beam_search(
    model: Decodable,
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
    model: Decodable,
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


@torch.inference_mode()
def beam_search(
    model: Decodable,
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
        model: a :class:`Transformer` in eval mode, an :class:`Ensemble` or an
            :class:`~qkv.decoding.inference.InferenceModel`.
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
    model = for_decoding(model, use_cache)
    memory = encode(model, src)
    max_len = _max_lengths(memory, extra_len, model.config.max_len - 1).tolist()
    finished: list[list[Hypothesis]] = [[] for _ in max_len]
    if max_len:
        _search(
            model,
            memory,
            beam_size,
            max_len,
            finished,
            bos_id=bos_id,
            eos_id=eos_id,
            alpha=alpha,
            penalty=penalty,
            use_cache=use_cache,
        )
    results = [sorted(hyps, key=lambda h: h.normalized, reverse=True) for hyps in finished]
    if return_all:
        return results
    return [hyps[0].tokens if hyps else [] for hyps in results]


def _search(
    model: Decodable,
    memory: EncoderOutput,
    k: int,
    max_len: list[int],
    finished: list[list[Hypothesis]],
    *,
    bos_id: int,
    eos_id: int,
    alpha: float,
    penalty: PenaltyForm,
    use_cache: bool,
) -> None:
    """:func:`beam_search`'s steps, adding each sentence's finished hypotheses to ``finished``.

    The batch holds ``k`` rows per sentence still searching (rows ``p*k ... p*k + k - 1`` the beams
    of sentence ``active[p]``); a sentence that is done leaves it, so that no step decodes rows
    whose result is already known. The first step decodes one row per sentence: every beam starts
    from BOS and only the first is alive, so the other ``k - 1`` rows would compute the same; its
    logits, caches and memory are then repeated ``k`` times."""
    b, device, pad_id = len(max_len), memory.hidden.device, model.config.pad_id
    tokens = torch.full((b, 1), bos_id, dtype=torch.long, device=device)  # (b, 1) then (b'*k, t)
    steps = decoder_steps(model, memory, use_cache)
    beams = torch.arange(b, device=device).repeat_interleave(k)  # (b*k,) the row each beam starts from
    logits = steps(tokens).index_select(0, beams)  # (b*k, V)
    tokens = tokens.index_select(0, beams)
    steps.select(beams, beams)
    scores = _first_scores(b, k, device)  # (b*k,)
    active = list(range(b))
    for step in range(max(max_len)):
        if step:
            logits = steps(tokens)
        candidates = _best_candidates(scores, logits, len(active), k)
        # the next step's rows: which old row each continues, its new token and its score
        rows = len(active) * k
        following = list(range(rows)), [pad_id] * rows, [float("-inf")] * rows
        kept = [
            p
            for p, i in enumerate(active)
            if not _advance_sentence(
                p,
                k,
                tokens,
                candidates[p],
                eos_id=eos_id,
                alpha=alpha,
                penalty=penalty,
                last_step=step + 1 >= max_len[i],
                finished=finished[i],
                following=following,
            )
        ]
        if not kept:
            break
        slots = [p * k + j for p in kept for j in range(k)]  # the kept sentences' rows
        source, token_at, score_at = ([column[slot] for slot in slots] for column in following)
        index = torch.tensor(source, device=device)
        tokens = torch.cat([tokens.index_select(0, index), torch.tensor(token_at, device=device)[:, None]], dim=1)
        scores = torch.tensor(score_at, device=device)
        # the memory and its keys/values are the same for every beam of a sentence: they only change
        # when a sentence leaves
        steps.select(index, torch.tensor(slots, device=device) if len(kept) < len(active) else None)
        active = [active[p] for p in kept]


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
    """One beam-search step of the sentence whose beams are the batch's rows ``i*k ... i*k + k - 1``,
    from its best candidates ``(score, beam, token)``, best first: one ending in EOS that ranks within the first ``k`` is finished (added to
    ``finished``); the best ``k`` others stay alive, written into rows ``i*k ...`` of
    ``following`` (the row each continues, its token, its score). Returns whether the sentence is
    done: it has ``k`` finished hypotheses, or this was its last step (``last_step``: its live
    hypotheses are then finished as they are, and ranked with the finished ones)."""
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
    if not last_step:
        return len(finished) >= k
    # out of length: the live hypotheses end here and compete with the finished ones, even when this
    # step filled the k-th finished slot (as Hugging Face's and CTranslate2's searches rank them)
    for slot in range(i * k, i * k + alive):
        prefix = tokens[source[slot], 1:].tolist() + [token_at[slot]]
        finished.append(
            Hypothesis(prefix, score_at[slot], score_at[slot] / length_penalty(len(prefix), alpha, penalty))
        )
    return True
