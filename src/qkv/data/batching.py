"""Token-count batching with length bucketing, and padded tensors for the model.

Sentences of similar length go together so little compute is spent on padding: the pairs are
sorted by length inside large random pools ("buckets"), cut into batches whose *padded* size
(``batch * longest``, source or target, whichever is larger) stays under ``max_tokens``, and the
batches are shuffled. Everything is driven by an explicit seed so a run can be resumed exactly.

Shape legend: ``b`` batch, ``s_src`` / ``s_tgt`` padded lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.num_tgt_tokens)


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


def token_batches(
    src_lengths: list[int],
    tgt_lengths: list[int],
    max_tokens: int,
    *,
    seed: int | None = 0,
    bucket_size: int = 100,
) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens.

    Args:
        src_lengths, tgt_lengths: token counts of each example (framing tokens included).
        max_tokens: bound on ``len(batch) * max(longest source, longest target)``; an example
            longer than ``max_tokens`` gets a batch of its own.
        seed: shuffles examples into pools and batches into an order; None keeps a deterministic
            length-sorted order (for evaluation).
        bucket_size: pools of ``bucket_size`` batches' worth of examples are sorted by length.

    Returns:
        lists of example indices, one per batch.
    """
    if len(src_lengths) != len(tgt_lengths):
        raise ValueError(f"{len(src_lengths)} source lengths but {len(tgt_lengths)} target lengths")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = list(range(len(src_lengths)))
    rng = random.Random(seed)
    if seed is not None:
        rng.shuffle(order)
    length = [max(s, t) for s, t in zip(src_lengths, tgt_lengths)]
    mean_len = max(1, sum(length) // max(1, len(length)))
    pool = max(1, bucket_size * max_tokens // mean_len) if seed is not None else len(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        # a stable sort keeps the shuffled order among equal lengths, so batches differ by epoch
        chunk = sorted(order[start : start + pool], key=lambda i: length[i])
        current: list[int] = []
        longest = 0
        for i in chunk:
            new_longest = max(longest, length[i])
            if current and new_longest * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, new_longest = [], length[i]
            current.append(i)
            longest = new_longest
        if current:
            batches.append(current)
    if seed is not None:
        rng.shuffle(batches)
    return batches
