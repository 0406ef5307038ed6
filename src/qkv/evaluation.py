"""Translate lists of sentences in length-sorted batches and score them with sacreBLEU.

Scores are sacreBLEU's own (cased, on detokenised text, the default ``13a`` tokenizer) and chrF,
reported with their signatures so a number can be reproduced; given the target language, also BLEU
in the forms papers publish (:mod:`qkv.bleu_forms`), each labelled with how it was made.
"""

from __future__ import annotations

import logging

import sacrebleu
from tqdm.auto import tqdm

from qkv.bleu_forms import published_forms
from qkv.data.batching import pad_sequences
from qkv.data.tokenizer import Tokenizer
from qkv.decoding import beam_search, greedy_decode
from qkv.models import Transformer
from qkv.precision import autocast_context

logger = logging.getLogger(__name__)


def translate_texts(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    beam_size: int = 1,
    alpha: float = 0.6,
    max_tokens: int = 4000,
    bf16: bool = False,
    progress: bool = False,
) -> list[str]:
    """Translate ``texts`` (batched by length; output in input order).

    Args:
        model: trained :class:`Transformer`; it is put in eval mode.
        tokenizer: the run's tokenizer.
        texts: source sentences.
        beam_size: 1 = greedy decoding, else beam search with length penalty ``alpha``.
        max_tokens: source tokens per batch (times ``beam_size`` rows are decoded).
        bf16: run under bfloat16 autocast (faster on CPUs with bf16 matrix units).
        progress: show a progress bar.

    Returns:
        the translations, one per input sentence.
    """
    model.eval()
    limit = model.config.max_len - 1  # source tokens that fit the positional table with EOS
    encoded = tokenizer.encode_batch(texts)
    too_long = sum(len(s) > limit for s in encoded)
    ids = [s[:limit] + [tokenizer.eos_id] for s in encoded]
    if too_long:
        logger.warning("%d sentence(s) longer than %d tokens were cut to fit the model", too_long, limit)
    results: list[str] = [""] * len(ids)
    batches = length_batches(ids, max(1, max_tokens // max(1, beam_size)))
    device = next(model.parameters()).device
    with autocast_context(device, bf16):
        for batch in tqdm(batches, desc="translating", disable=not progress, leave=False):
            src = pad_sequences([ids[i] for i in batch], model.config.pad_id).to(device)
            kwargs = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
            if beam_size == 1:
                out = greedy_decode(model, src, **kwargs)
            else:
                out = beam_search(model, src, beam_size=beam_size, alpha=alpha, **kwargs)
            for i, tokens in zip(batch, out):
                results[i] = tokenizer.decode(tokens)
    return results


def length_batches(ids: list[list[int]], budget: int) -> list[list[int]]:
    """Group the indices of ``ids`` (token lists) into batches of similar length, shortest first, each
    holding at most ``budget`` tokens once padded to its longest (a longer sentence gets a batch of
    its own)."""
    batches, current = [], []
    for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):
        if current and len(ids[i]) * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def score_translations(hypotheses: list[str], references: list[str], *, target_lang: str | None = None) -> dict:
    """sacreBLEU BLEU and chrF of detokenised ``hypotheses`` against one reference each.

    Args:
        hypotheses: system output, one sentence each.
        references: one reference each, line-aligned.
        target_lang: the target language (e.g. ``de``): adds BLEU in the papers' form and, for
            German, tokenized BLEU with compound splitting (:func:`qkv.bleu_forms.published_forms`).

    Returns:
        ``{"bleu", "chrf", "bleu_signature", "chrf_signature", "bleu_details"}``; with
        ``target_lang`` also ``"bleu_papers_form"`` (and ``"bleu_compound_split"``), each
        ``{"bleu", "form", "details"}``.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu_metric, chrf_metric = sacrebleu.BLEU(), sacrebleu.CHRF()
    bleu = bleu_metric.corpus_score(hypotheses, [references])
    chrf = chrf_metric.corpus_score(hypotheses, [references])
    scores = {
        "bleu": round(bleu.score, 2),
        "chrf": round(chrf.score, 2),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
        "bleu_details": str(bleu),
    }
    if target_lang is not None:
        scores.update(published_forms(hypotheses, references, target_lang))
    return scores


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Fraction of hypotheses equal to their reference, character for character."""
    if len(hypotheses) != len(references) or not references:
        raise ValueError(f"need equally many hypotheses and references, got {len(hypotheses)} and {len(references)}")
    return sum(h == r for h, r in zip(hypotheses, references)) / len(references)
