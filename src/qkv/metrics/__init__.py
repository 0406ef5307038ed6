"""Scores: sacreBLEU's BLEU and chrF with their signatures, the BLEU forms papers publish, exact
match, and paired significance between systems."""

from qkv.metrics.scores import exact_match, score_translations
from qkv.metrics.significance import paired_significance

__all__ = ["exact_match", "paired_significance", "score_translations"]
