"""Token-count batching with length bucketing, and padded tensors for the model.

Sentences of similar length go together so little compute is spent on padding: the pairs are
sorted by length inside large random pools ("buckets"), cut into batches whose *padded* size
(``batch * longest``, source or target, whichever is larger) stays under ``max_tokens``, and the
batches are shuffled. Everything is driven by an explicit seed so a run can be resumed exactly.
The plan is numpy arrays (:class:`BatchPlan`), so that a corpus of millions of pairs costs a few
bytes a pair, not a Python object each.

Shape legend: ``b`` batch, ``s_src`` / ``s_tgt`` padded lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch
from torch import Tensor


@dataclass
class Batch:
    """One padded batch. Padding masks follow the model's convention (``ids != pad_id``)."""

    src: Tensor  # (b, s_src) source ids, then EOS, right-padded
    tgt_in: Tensor  # (b, s_tgt) BOS + target ids (decoder input, shifted right)
    tgt_out: Tensor  # (b, s_tgt) target ids + EOS (what the decoder predicts), pad = pad_id
    num_tgt_tokens: int  # real (non-pad) tokens in tgt_out

    @property
    def size(self) -> int:
        """Number of sentence pairs ``b``."""
        return self.src.size(0)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device`` (non-blocking copies)."""
        return Batch(
            self.src.to(device, non_blocking=True),
            self.tgt_in.to(device, non_blocking=True),
            self.tgt_out.to(device, non_blocking=True),
            self.num_tgt_tokens,
        )


def pad_sequences(seqs: list[list[int]], pad_id: int) -> Tensor:
    """Right-pad integer lists into a ``(len(seqs), longest)`` int64 tensor."""
    if not seqs:
        raise ValueError("cannot pad an empty list of sequences")
    longest = max(len(s) for s in seqs)
    out = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def make_batch(src: list[list[int]], tgt: list[list[int]], *, pad_id: int, bos_id: int, eos_id: int) -> Batch:
    """Build a :class:`Batch` from raw (unframed) token id lists."""
    tgt_out = pad_sequences([t + [eos_id] for t in tgt], pad_id)
    return Batch(
        src=pad_sequences([s + [eos_id] for s in src], pad_id),
        tgt_in=pad_sequences([[bos_id] + t for t in tgt], pad_id),
        tgt_out=tgt_out,
        num_tgt_tokens=int((tgt_out != pad_id).sum()),
    )


class BatchPlan(Sequence):
    """An epoch's batches as example indices: ``plan[k]`` is batch ``k``'s list of indices.

    Kept as three numpy arrays (the examples in bucketed order, where each batch starts in it,
    and the batches' shuffled order), so a plan over millions of examples costs 4-8 bytes an
    example instead of a Python object each. Compares equal to a plan or list with the same batches.
    """

    def __init__(self, order: np.ndarray, bounds: np.ndarray, batch_order: np.ndarray) -> None:
        self.order, self.bounds, self.batch_order = order, bounds, batch_order

    def __len__(self) -> int:
        return len(self.batch_order)

    @overload
    def __getitem__(self, k: int) -> list[int]: ...

    @overload
    def __getitem__(self, k: slice) -> list[list[int]]: ...

    def __getitem__(self, k: int | slice) -> list[int] | list[list[int]]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        b = int(self.batch_order[k])
        return self.order[self.bounds[b] : self.bounds[b + 1]].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (BatchPlan, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == list(b) for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # a plan is compared by its batches, so it is not hashable

    def __repr__(self) -> str:
        return f"BatchPlan({len(self)} batches of {len(self.order)} examples)"


def bucket_batches(
    lengths: np.ndarray,
    max_tokens: int,
    *,
    seed: int | None = 0,
    bucket_size: int = 100,
    indices: np.ndarray | None = None,
) -> BatchPlan:
    """Group examples into batches of at most ``max_tokens`` padded tokens.

    Args:
        lengths: each example's padded length (the longer of its framed source and target).
        max_tokens: bound on ``len(batch) * longest``; an example longer than ``max_tokens`` gets
            a batch of its own.
        seed: shuffles the examples into pools and the batches into an order (numpy's PCG64);
            None keeps a deterministic length-sorted order (for evaluation).
        bucket_size: pools of ``bucket_size`` batches' worth of examples are sorted by length.
        indices: the examples to use (default: all); the same seed shuffles any ``indices`` of a
            given size the same way, so a subset renumbered 0..K-1 gets the same batches.

    Returns:
        a :class:`BatchPlan`.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    lengths = np.asarray(lengths)
    index_type = np.int32 if len(lengths) < 2**31 else np.int64
    order = (
        np.arange(len(lengths), dtype=index_type) if indices is None else np.array(indices, dtype=index_type)
    )  # a copy: shuffled and sorted in place
    rng = np.random.default_rng(seed) if seed is not None else None
    if rng is not None:
        rng.shuffle(order)
    n = len(order)
    mean_len = max(1, int(lengths[order].sum(dtype=np.int64)) // max(1, n)) if n else 1
    pool = max(1, bucket_size * max_tokens // mean_len) if rng is not None else max(1, n)
    starts: list[np.ndarray] = []
    for first in range(0, n, pool):
        chunk = order[first : first + pool]
        keys = lengths[chunk].astype(np.int64)
        by_length = np.argsort(keys, kind="stable")  # stable: equal lengths keep the shuffled order
        chunk[:] = chunk[by_length]
        starts.append(first + _greedy_cuts(keys[by_length], max_tokens))
    bounds = np.concatenate([*starts, np.array([n], dtype=np.int64)]).astype(np.int64)
    count = len(bounds) - 1
    batch_order = rng.permutation(count) if rng is not None else np.arange(count)
    return BatchPlan(order, bounds, batch_order)


def _greedy_cuts(sorted_lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where each batch starts in ascending ``sorted_lengths``, filling each batch while
    ``(size + 1) * next length <= max_tokens``. Lengths ascend, so that product ascends too and
    each batch's end is found with one vectorised comparison over at most ``max_tokens // first
    length`` examples."""
    cuts, start, total = [], 0, len(sorted_lengths)
    while start < total:
        cuts.append(start)
        room = min(max_tokens // max(1, int(sorted_lengths[start])), total - start)
        if room <= 1:
            start += 1
            continue
        fits = sorted_lengths[start + 1 : start + room] * np.arange(2, room + 1) <= max_tokens
        start += 1 + (len(fits) if fits.all() else int(np.argmin(fits)))
    return np.array(cuts, dtype=np.int64)


def token_batches(
    src_lengths: Sequence[int] | np.ndarray,
    tgt_lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    seed: int | None = 0,
    bucket_size: int = 100,
) -> BatchPlan:
    """:func:`bucket_batches` over examples with the given source and target token counts
    (framing tokens included): a batch's padded size is its size times its longest source or
    target, whichever is larger."""
    if len(src_lengths) != len(tgt_lengths):
        raise ValueError(f"{len(src_lengths)} source lengths but {len(tgt_lengths)} target lengths")
    return bucket_batches(
        np.maximum(np.asarray(src_lengths), np.asarray(tgt_lengths)), max_tokens, seed=seed, bucket_size=bucket_size
    )
