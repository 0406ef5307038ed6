"""Token ids for many sentences at once, equal to :meth:`Tokenizer.encode`, several times faster:
what ``qkv prepare`` tokenizes a corpus of millions of sentences with.

Byte-level BPE splits a text into pieces with GPT-2's pattern and applies BPE to each piece on its
own, so a text's ids are its pieces' ids end to end. The ``tokenizers`` library spends most of its
time in that split (an Oniguruma regex); this module splits in Python instead, then looks each
piece up in a cache of pieces already encoded; the pieces not yet seen are encoded by the tokenizer
itself, all of a batch in one call. Zipf's law does the rest: a few hundred thousand pieces cover
nearly every word of a corpus.

- ASCII text: Python's ``re`` with the pattern spelled in ASCII classes, exact on ASCII input
  (``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]``, ``\\s`` is tab, newline, vertical tab, form
  feed, carriage return and space).
- Text in Latin scripts (every character in :data:`LATIN_TEXT`: Latin-1, Latin Extended-A/B, IPA,
  combining diacritics, general punctuation such as curly quotes and dashes, currency signs): the
  ``regex`` module with GPT-2's own pattern; the tests check that it splits every one of those
  characters, in several contexts, as the tokenizer does (German, French and the like: 69% of
  Multi30k's German sentences are not ASCII).

Everything else goes to the tokenizer as it is: a text with another character (where the two
regex engines' Unicode tables might differ), one holding a special token's text (``</s>``), and
every text when the tokenizer is not plain byte-level BPE (a normalizer, digits split apart, BPE
dropout).
"""

from __future__ import annotations

import json
import re
from itertools import chain
from operator import itemgetter

import numpy as np
import numpy.typing as npt
import regex

from qkv.data.tokenizer import Tokenizer

_SPACE = r"\t\n\x0b\x0c\r "
# GPT-2's pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) for ASCII text
ASCII_PIECES = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)
# GPT-2's pattern as the tokenizer spells it, for the regex module (which knows \p{L} and \p{N})
UNICODE_PIECES = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
# the characters whose split the tests check against the tokenizer's (see the module docstring)
LATIN_RANGES = "\x00-\u036f\u1e00-\u1eff\u2000-\u206f\u20a0-\u20c0"
LATIN_TEXT = re.compile(f"[{LATIN_RANGES}]*")


def is_plain_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` is byte-level BPE with GPT-2's split and nothing around it (no
    normalizer, no post-processor, no dropout): what :class:`CachedEncoder` reproduces."""
    config = json.loads(tokenizer.backend.to_str())
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    return (
        config.get("normalizer") is None
        and config.get("post_processor") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
    )


def split_pieces(text: str) -> list[str]:
    """GPT-2's pieces of an ASCII or :data:`LATIN_TEXT` text."""
    return (ASCII_PIECES if text.isascii() else UNICODE_PIECES).findall(text)


class CachedEncoder:
    """Encodes lists of texts into one flat id array and the texts' lengths.

    Args:
        tokenizer: the tokenizer whose ids to produce.
        dtype: the id array's type (``uint16`` where the vocabulary fits, else ``uint32``).
        cache_size: pieces kept; when full the cache starts again (a bound on memory: about
            150 bytes a piece).
    """

    def __init__(self, tokenizer: Tokenizer, *, dtype: npt.DTypeLike = np.uint16, cache_size: int = 500_000) -> None:
        self.backend = tokenizer.backend
        self.dtype = np.dtype(dtype)
        if tokenizer.vocab_size > np.iinfo(self.dtype).max + 1:
            raise ValueError(f"a vocabulary of {tokenizer.vocab_size} does not fit {self.dtype}")
        self.fast = is_plain_byte_level(tokenizer)
        self.added = [token["content"] for token in json.loads(self.backend.to_str()).get("added_tokens", [])]
        self.cache: dict[str, bytes] = {}
        self.cache_size = cache_size

    def _fast(self, text: str) -> bool:
        return self.fast and LATIN_TEXT.fullmatch(text) is not None and not any(token in text for token in self.added)

    def _ids_bytes(self, ids: list[int]) -> bytes:
        return np.asarray(ids, dtype=self.dtype).tobytes()

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``texts`` (no BOS/EOS), exactly ``[tokenizer.encode(t) for t in texts]``.

        Returns:
            ``(flat ids, lengths)``: the texts' ids end to end (``dtype``) and each text's count
            (int64), so text ``i`` is ``flat[sum(lengths[:i]) : sum(lengths[:i + 1])]``.
        """
        if self.fast and self._all_fast(texts):  # the usual case, checked once for the whole list
            ascii_pieces = list(map(ASCII_PIECES.findall, texts))
            self._cache_pieces(set().union(*ascii_pieces))
            return self._join_cached(ascii_pieces)
        fast = [self._fast(t) for t in texts]
        pieces: list[list[str] | None] = [split_pieces(t) if f else None for t, f in zip(texts, fast)]
        self._cache_pieces(set().union(*(ps for ps in pieces if ps is not None)))
        cache = self.cache
        slow = [t for t, f in zip(texts, fast) if not f]
        slow_ids = iter(self.backend.encode_batch(slow, add_special_tokens=False) if slow else [])
        parts = [
            b"".join([cache[p] for p in ps]) if ps is not None else self._ids_bytes(next(slow_ids).ids) for ps in pieces
        ]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)) // self.dtype.itemsize
        return np.frombuffer(b"".join(parts), dtype=self.dtype), lengths

    def _cache_pieces(self, distinct: set[str]) -> None:
        """Encode the pieces of ``distinct`` not yet cached, all in one call (set operations in C:
        ``set.difference`` of a dict looks each element up in it)."""
        unseen = distinct.difference(self.cache)
        if len(self.cache) + len(unseen) > self.cache_size:  # start again, with this batch's pieces
            self.cache.clear()
            unseen = distinct
        if unseen:
            ordered = list(unseen)
            encoded = self.backend.encode_batch(ordered, add_special_tokens=False)
            self.cache.update(zip(ordered, (self._ids_bytes(e.ids) for e in encoded)))

    def _join_cached(self, pieces: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        """Every text's cached pieces end to end, looked up in one ``itemgetter`` call, and each
        text's id count (its pieces' counts summed)."""
        flat = list(chain.from_iterable(pieces))
        if not flat:
            return np.zeros(0, dtype=self.dtype), np.zeros(len(pieces), dtype=np.int64)
        found = itemgetter(*flat)(self.cache)
        if len(flat) == 1:  # itemgetter of one key gives the value, not a tuple
            found = (found,)
        piece_ids = np.fromiter(map(len, found), dtype=np.int64, count=len(flat)) // self.dtype.itemsize
        ends = np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)))
        total = np.concatenate([[0], np.cumsum(piece_ids)])
        lengths = total[ends] - total[np.concatenate([[0], ends[:-1]])]
        return np.frombuffer(b"".join(found), dtype=self.dtype), lengths

    def _all_fast(self, texts: list[str]) -> bool:
        """Whether every text is ASCII without a special token's text (one check over all of them;
        the separator is ASCII and cannot complete a special token's text)."""
        joined = "\n".join(texts)
        return joined.isascii() and not any(token in joined for token in self.added)
