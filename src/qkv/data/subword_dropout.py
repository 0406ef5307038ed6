"""Subword dropout: a fresh segmentation of every training sentence on every pass over the data.

BPE builds each token of its vocabulary by joining two smaller ones (its merge). Here each token of
a sentence's stored segmentation is split back into its two parts with probability ``p``, and each
part is split again with probability ``p``, down to single bytes, so the model sees a word cut in
different ways from epoch to epoch and learns its pieces as well as the whole (a regulariser in the
spirit of BPE-dropout, Provilkov et al. 2020, "BPE-Dropout: Simple and Effective Subword
Regularization", which skips merges while encoding text; splitting stored ids instead works on
prepared token files too and needs no text).

The choice for each piece is a hash of (seed, epoch, example, side, position, piece), not a random
stream: the same example gets the same segmentation in the same epoch on every process, after a
resume, and in whatever batch it lands. Only training batches are split; validation, evaluation and
decoding use the stored segmentation.
"""

from __future__ import annotations

import json

import numpy as np

from qkv.data.tokenizer import Tokenizer

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def merge_parts(tokenizer: Tokenizer) -> np.ndarray:
    """A ``(vocab_size, 2)`` table: the two token ids each token was merged from, ``-1`` for tokens
    that are no merge (byte symbols and specials)."""
    model = json.loads(tokenizer.backend.to_str())["model"]
    vocab = model["vocab"]
    parts = np.full((tokenizer.vocab_size, 2), -1, dtype=np.int64)
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        joined = vocab.get(left + right)
        if joined is not None and parts[joined, 0] < 0:  # the first merge that makes a token is the one BPE uses
            parts[joined] = vocab[left], vocab[right]
    return parts


def _uniform(*keys: np.ndarray | int) -> np.ndarray:
    """A uniform number in [0, 1) per element, a hash (splitmix64's finaliser) of the keys: the
    same keys always give the same number."""
    x = np.zeros(np.broadcast(*keys).shape, dtype=np.uint64)
    for key in keys:
        x = (x ^ np.asarray(key, dtype=np.uint64)) * _GOLDEN
        x ^= x >> np.uint64(31)
        x *= _MIX[0]
        x ^= x >> np.uint64(29)
        x *= _MIX[1]
        x ^= x >> np.uint64(32)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


class SubwordDropout:
    """Splits training sequences' tokens into their merge parts (see the module's description).

    Args:
        tokenizer: the run's tokenizer (its merges say how tokens split).
        p: the probability that a token, or a part of one, is split (0 < p < 1).
        seed: the run's seed.
        max_len: a sequence is kept as it is where splitting would make it longer than this
            (tokens, the EOS or BOS the batch adds not counted).
    """

    def __init__(self, tokenizer: Tokenizer, p: float, seed: int, max_len: int) -> None:
        if not 0 < p < 1:
            raise ValueError(f"subword dropout must be in (0, 1), got {p!r}")
        self.parts, self.p, self.seed, self.max_len = merge_parts(tokenizer), float(p), int(seed), int(max_len)

    def split_pairs(
        self, src: list[list[int]], tgt: list[list[int]], examples: list[int], *, epoch: int
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Both sides of the pairs ``examples`` as this epoch cuts them."""
        return self.split(src, examples, epoch=epoch, side=0), self.split(tgt, examples, epoch=epoch, side=1)

    def split(self, sequences: list[list[int]], examples: list[int], *, epoch: int, side: int) -> list[list[int]]:
        """``sequences`` (the token ids of ``examples``, one side of each pair: 0 source, 1 target)
        as this epoch cuts them."""
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        if not lengths.sum():
            return [list(s) for s in sequences]
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
        row = np.repeat(np.arange(len(sequences)), lengths)
        position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        key = np.repeat(np.asarray(examples, dtype=np.int64), lengths)
        node = np.ones(len(ids), dtype=np.int64)  # the piece's place in its token's merge tree (1 = the token)
        fresh = np.ones(len(ids), dtype=bool)  # pieces not yet considered for a split
        while True:
            u = _uniform(self.seed, epoch, key, side, position, node)
            cut = fresh & (self.parts[ids, 0] >= 0) & (u < self.p)
            if not cut.any():
                break
            source = np.repeat(np.arange(len(ids)), 1 + cut)  # a cut piece becomes two
            is_right = np.zeros(len(source), dtype=bool)
            is_right[1:] = source[1:] == source[:-1]
            was_cut = cut[source]
            new_ids, new_node = ids[source], node[source]
            new_ids[was_cut] = self.parts[new_ids[was_cut], is_right[was_cut].astype(np.int64)]
            new_node[was_cut] = 2 * new_node[was_cut] + is_right[was_cut]
            ids, node, fresh = new_ids, new_node, was_cut
            row, position, key = row[source], position[source], key[source]
        counts = np.bincount(row, minlength=len(sequences))
        pieces = np.split(ids, np.cumsum(counts)[:-1])
        return [p.tolist() if len(p) <= self.max_len else list(s) for p, s in zip(pieces, sequences)]
