"""Translate lists of sentences in length-sorted batches and score them with sacreBLEU.

Scores are sacreBLEU's own (cased, on detokenised text, the default ``13a`` tokenizer) and chrF,
reported with their signatures so a number can be reproduced; given the target language, also BLEU
in the forms papers publish (:mod:`qkv.bleu_forms`), each labelled with how it was made.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import sacrebleu
from sacrebleu.significance import PairedTest
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


def read_translations(path: str | Path) -> list[str]:
    """The translations in a UTF-8 file written one per line (``val.hyp.de``), each line one
    sentence: an empty line is an empty translation, and the newline after the last one does not
    start another."""
    text = Path(path).read_text(encoding="utf-8")
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def paired_significance(systems: dict[str, list[str]], references: list[str], *, resamples: int = 1000,
                        trials: int = 10000, seed: int = 12345) -> dict[str, dict]:
    """How far apart corpus BLEU scores on one test set are from chance, every system against the
    first (the baseline), by sacreBLEU's two paired tests (sacrebleu.significance): paired bootstrap
    resampling (Koehn 2004; ``resamples`` resamples of the sentences, giving each score's bootstrap mean
    and 95% confidence interval) and approximate randomization (Riezler and Maxwell 2005; ``trials``
    random swaps of the two systems' sentences). Both are two-sided: the chance of a difference at least
    this large, either way, were the two systems the same; the baseline has none.

    sacreBLEU counts only the resampled differences strictly larger than the observed one, so where
    only a few sentences differ from the baseline's, every random swap reproduces the observed
    difference and approximate randomization reports a small p for a tiny difference: ``differing``
    says how many sentences differ, and a system identical to the baseline gets p = 1 from both tests
    (no difference at all) rather than sacreBLEU's 1 / (trials + 1).

    Returns ``{name: {"bleu", "bootstrap_mean", "ci95", "p_bootstrap", "p_randomization", "differing"}}``
    (ci95 is the half-width: the interval is mean +- ci95; the baseline's p-values and ``differing``
    are None).
    """
    if len(systems) < 2:
        raise ValueError("need a baseline and at least one system to compare with it")
    for name, hyps in systems.items():
        if len(hyps) != len(references):
            raise ValueError(f"{name}: {len(hyps)} translations for {len(references)} references")
    named = list(systems.items())
    saved = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)  # sacreBLEU reads its seed from here
    try:
        _, bootstrap = PairedTest(named, {"BLEU": sacrebleu.BLEU()}, [references], test_type="bs",
                                  n_samples=resamples)()
        _, randomization = PairedTest(named, {"BLEU": sacrebleu.BLEU()}, [references], test_type="ar",
                                      n_samples=trials)()
    finally:
        if saved is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = saved
    out = {}
    baseline = named[0][1]
    for i, (name, hyps) in enumerate(named):
        bs, ar = bootstrap["BLEU"][i], randomization["BLEU"][i]
        differing = None if i == 0 else sum(a != b for a, b in zip(hyps, baseline))
        out[name] = {"bleu": round(float(bs.score), 2), "bootstrap_mean": round(float(bs.mean), 2),
                     "ci95": round(float(bs.ci), 2),
                     "p_bootstrap": None if i == 0 else 1.0 if differing == 0 else round(float(bs.p_value), 4),
                     "p_randomization": None if i == 0 else 1.0 if differing == 0 else round(float(ar.p_value), 4),
                     "differing": differing}
    return out


def significance_lines(results: dict[str, dict]) -> list[str]:
    """:func:`paired_significance`'s results as lines to print: each system's BLEU and 95% interval,
    and after the baseline (the first) its difference from it with both p-values, then the name."""
    baseline = next(iter(results.values()))["bleu"]
    lines = []
    for name, r in results.items():
        low, high = r["bootstrap_mean"] - r["ci95"], r["bootstrap_mean"] + r["ci95"]
        line = f"BLEU {r['bleu']:6.2f}  95% {low:6.2f}-{high:<6.2f}"
        if r["p_bootstrap"] is None:
            line += f"  {'(baseline)':>61s}"
        else:
            line += (f"  {r['bleu'] - baseline:+6.2f}  p {r['p_bootstrap']:.3f} (bootstrap) "
                     f"{r['p_randomization']:.3f} (randomization)  {r['differing']:5d} differ")
        lines.append(f"{line}  {name}")
    return lines


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Fraction of hypotheses equal to their reference, character for character."""
    if len(hypotheses) != len(references) or not references:
        raise ValueError(f"need equally many hypotheses and references, got {len(hypotheses)} and {len(references)}")
    return sum(h == r for h, r in zip(hypotheses, references)) / len(references)
