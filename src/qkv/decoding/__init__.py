"""Decoding: batched greedy and beam search (cache-aware), an ensemble of translation models, and
translating a list of sentences in length-sorted batches."""

from qkv.decoding.search import beam_search, greedy_decode, length_penalty
from qkv.decoding.translate import translate_texts

__all__ = ["beam_search", "greedy_decode", "length_penalty", "translate_texts"]
