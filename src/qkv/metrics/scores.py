"""Score translations with sacreBLEU: BLEU (cased, detokenised, the ``13a`` tokenizer) and chrF,
reported with their signatures so a number can be reproduced; given the target language, also BLEU
in the forms papers publish (:mod:`qkv.metrics.bleu_forms`), each labelled with how it was made.
"""

from __future__ import annotations

import logging
from pathlib import Path

import sacrebleu

from qkv.metrics.bleu_forms import published_forms

logger = logging.getLogger(__name__)


def score_translations(hypotheses: list[str], references: list[str], *, target_lang: str | None = None) -> dict:
    """sacreBLEU BLEU and chrF of detokenised ``hypotheses`` against one reference each.

    Args:
        hypotheses: system output, one sentence each.
        references: one reference each, line-aligned.
        target_lang: the target language (e.g. ``de``): adds BLEU in the papers' form and, for
            German, tokenized BLEU with compound splitting (:func:`qkv.metrics.bleu_forms.published_forms`).

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


def read_translations(path: str | Path) -> list[str]:
    """The translations in a UTF-8 file written one per line (``val.hyp.de``), each line one
    sentence: an empty line is an empty translation, and the newline after the last one does not
    start another."""
    text = Path(path).read_text(encoding="utf-8")
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Fraction of hypotheses equal to their reference, character for character."""
    if len(hypotheses) != len(references) or not references:
        raise ValueError(f"need equally many hypotheses and references, got {len(hypotheses)} and {len(references)}")
    return sum(h == r for h, r in zip(hypotheses, references)) / len(references)
