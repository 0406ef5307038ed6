"""BLEU in the forms that papers report, next to sacreBLEU's.

sacreBLEU (:func:`qkv.metrics.scores.score_translations`) scores detokenised, cased text with its own
``13a`` tokenizer and prints a signature, so a figure can be reproduced anywhere. Published tables
were mostly made otherwise, on text tokenized with the Moses scripts and scored with Moses'
``multi-bleu.perl``; their numbers are not comparable with sacreBLEU's until both sides are
converted the same way. Two such forms are computed here, each on the hypotheses *and* the
references, then scored as whitespace-separated tokens:

* **the papers' form** (Multi30k papers): lowercased, Moses punctuation normalisation, Moses
  tokenization with the target language's rules, in that order: the order of the Multi30k
  dataset's own ``scripts/task1-tokenize.sh`` (``lowercase.perl | normalize-punctuation.perl -l L
  | tokenizer.perl -l L``), whose outputs are its ``*.lc.norm.tok.*`` files. The order matters:
  the tokenizer keeps a period attached when a lowercase word follows.
* **tokenized BLEU with compound splitting** (the WMT 2014 English-German figures of "Attention
  Is All You Need", GNMT and ConvS2S; tensor2tensor's ``get_ende_bleu.sh``): Moses tokenization
  with the German rules, case kept, then every ``X-Y`` with non-space characters either side
  becomes ``X ##AT##-##AT## Y``, hypotheses and references alike. The substitution scans left to
  right without overlaps, as Perl's ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`` does, so ``a-b-c``
  becomes ``a ##AT##-##AT## b-c`` there and here.

Both are scored as ``multi-bleu.perl`` scores tokens: corpus n-gram precisions up to 4, the
brevity penalty, no smoothing (sacreBLEU with ``tokenize="none"``, ``smooth_method="none"``).
The Moses steps run through ``sacremoses`` (the Python port of the Moses scripts) with
``perl_parity=True`` for the normaliser, so a lone ``’`` becomes ``"`` as in the Perl script.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import sacrebleu

PAPERS_FORM = (
    "papers' form: lowercased, Moses punctuation normalisation and Moses tokenization ({lang} rules, "
    "sacremoses), BLEU on the tokens as multi-bleu.perl computes it (how Multi30k papers report BLEU)"
)
COMPOUND_SPLIT_FORM = (
    "tokenized with compound splitting: Moses tokenization ({lang} rules, sacremoses), case kept, "
    "a-b -> a ##AT##-##AT## b, BLEU on the tokens as multi-bleu.perl computes it (the Transformer "
    "paper's WMT En-De metric, tensor2tensor's get_ende_bleu.sh)"
)
# the languages whose references are scored with compound splitting as well (the WMT En-De convention)
COMPOUND_SPLIT_LANGS = ("de",)
_COMPOUND = re.compile(r"(\S)-(\S)")


@cache
def _normalizer(lang: str) -> Any:  # sacremoses ships no types
    from sacremoses import MosesPunctNormalizer

    return MosesPunctNormalizer(lang=lang, perl_parity=True)


@cache
def _tokenizer(lang: str) -> Any:  # sacremoses ships no types
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang=lang)


def check_lang(lang: str, what: str = "language") -> str:
    """``lang`` if it is a 2- or 3-letter lowercase code (``de``), else ``ValueError`` naming ``what``."""
    if not isinstance(lang, str) or not re.fullmatch(r"[a-z]{2,3}", lang):
        raise ValueError(f"{what} must be a 2- or 3-letter lowercase language code such as de, got {lang!r}")
    return lang


def moses_tokenize(text: str, lang: str) -> str:
    """Moses ``tokenizer.perl -l lang`` (no aggressive hyphen splitting; entities not escaped,
    which changes no token boundary): the tokens of ``text`` joined by single spaces."""
    return _tokenizer(check_lang(lang)).tokenize(text, return_str=True, escape=False)


def papers_form(text: str, lang: str) -> str:
    """``text`` as Multi30k papers score it: lowercased, Moses-normalised, Moses-tokenized.

    Example: ``papers_form("Don't stop, Mr. Smith!", "en") == "don 't stop , mr. smith !"``.
    """
    lang = check_lang(lang)
    return moses_tokenize(_normalizer(lang).normalize(text.lower()), lang)


def split_compounds(tokenized: str) -> str:
    """``X-Y`` -> ``X ##AT##-##AT## Y`` in tokenized text (left to right, no overlaps)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def compound_split_form(text: str, lang: str) -> str:
    """``text`` as the Transformer paper scored WMT En-De: Moses-tokenized (case kept), compounds split."""
    return split_compounds(moses_tokenize(text, lang))


def token_bleu(hypotheses: list[str], references: list[str]) -> sacrebleu.metrics.bleu.BLEUScore:
    """Corpus BLEU of already tokenized text, as ``multi-bleu.perl`` computes it: tokens are the
    whitespace-separated words, case-sensitive, no smoothing (a zero n-gram precision gives 0)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    return sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", smooth_method="none", force=True)


def published_forms(hypotheses: list[str], references: list[str], lang: str) -> dict:
    """BLEU of detokenised ``hypotheses`` against ``references`` in the published forms for target
    language ``lang``.

    Args:
        hypotheses: system output, one detokenised sentence each.
        references: one reference each, line-aligned.
        lang: the target language (its Moses rules), e.g. ``de``.

    Returns:
        ``{"bleu_papers_form": {"bleu", "form", "details"}}``, plus ``"bleu_compound_split"`` (same
        keys) when ``lang`` is German.
    """
    lang = check_lang(lang)
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    papers = token_bleu([papers_form(h, lang) for h in hypotheses], [papers_form(r, lang) for r in references])
    result = {"bleu_papers_form": _entry(papers, PAPERS_FORM.format(lang=lang))}
    if lang in COMPOUND_SPLIT_LANGS:
        split = token_bleu(
            [compound_split_form(h, lang) for h in hypotheses], [compound_split_form(r, lang) for r in references]
        )
        result["bleu_compound_split"] = _entry(split, COMPOUND_SPLIT_FORM.format(lang=lang))
    return result


def _entry(score: sacrebleu.metrics.bleu.BLEUScore, form: str) -> dict:
    return {"bleu": round(score.score, 2), "form": form, "details": str(score)}
