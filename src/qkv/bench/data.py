"""Batches for the model benchmarks: real Multi30k batches (joint BPE, token-count batching, as
training uses them) or synthetic ones of a given shape (for smoke tests).

Shape legend: ``b`` sentences, ``s_src`` / ``s_tgt`` padded lengths.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkv.data.batching import Batch, make_batch, token_batches

logger = logging.getLogger(__name__)


@dataclass
class BenchData:
    """Training batches and decoding sources, with the ids a model needs."""

    batches: list[Batch]  # training batches, all contenders see the same ones in the same order
    sources: list[list[int]]  # held-out source sentences (ids, no EOS) for the decoding benchmark
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    description: str
    info: dict = field(default_factory=dict)

    def to(self, device: torch.device) -> BenchData:
        """The same data with every batch on ``device``."""
        moved = [
            Batch(b.src.to(device), b.tgt_in.to(device), b.tgt_out.to(device), b.num_tgt_tokens) for b in self.batches
        ]
        return BenchData(
            moved,
            self.sources,
            self.vocab_size,
            self.pad_id,
            self.bos_id,
            self.eos_id,
            self.description,
            dict(self.info),
        )


def multi30k_data(
    data_dir: str | Path | None,
    *,
    vocab_size: int = 8000,
    max_tokens: int = 6000,
    num_batches: int = 16,
    train_limit: int = 0,
    src_lang: str = "en",
    tgt_lang: str = "de",
    seed: int = 0,
) -> BenchData:
    """Real Multi30k training batches: a joint byte-level BPE trained on the training pairs,
    length-bucketed token-count batches (``max_tokens`` padded tokens each), the first
    ``num_batches`` of a seeded epoch; and the validation sources for decoding.

    Args:
        data_dir: a folder holding the Multi30k task-1 files (None: qkv's usual places, see
            :func:`qkv.data.parallel.resolve_multi30k`).
        vocab_size: BPE vocabulary size.
        max_tokens: padded tokens per batch.
        num_batches: how many batches to keep.
        train_limit: use only the first N training pairs (0 = all), for quick runs.
        src_lang, tgt_lang: the language pair.
        seed: batch order.
    """
    from qkv.data.parallel import load_multi30k, resolve_multi30k
    from qkv.data.tokenizer import Tokenizer

    folder = resolve_multi30k(data_dir, download=False)
    train = load_multi30k(folder, "train", src_lang, tgt_lang)
    valid = load_multi30k(folder, "val", src_lang, tgt_lang)
    src_text, tgt_text = train.src, train.tgt
    if train_limit:
        src_text, tgt_text = src_text[:train_limit], tgt_text[:train_limit]
    tokenizer = Tokenizer.train(src_text + tgt_text, vocab_size=vocab_size)
    src_ids, tgt_ids = tokenizer.encode_batch(src_text), tokenizer.encode_batch(tgt_text)
    order = token_batches([len(s) + 1 for s in src_ids], [len(t) + 1 for t in tgt_ids], max_tokens, seed=seed)
    batches = [
        make_batch(
            [src_ids[i] for i in index],
            [tgt_ids[i] for i in index],
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
        )
        for index in order[:num_batches]
    ]
    sources = tokenizer.encode_batch(valid.src)
    info = {
        "train_pairs": len(src_text),
        "vocab_size": tokenizer.vocab_size,
        "max_tokens": max_tokens,
        "batches": len(batches),
        "mean_sentences_per_batch": round(sum(b.size for b in batches) / len(batches), 1),
        "mean_target_tokens_per_batch": round(sum(b.num_tgt_tokens for b in batches) / len(batches), 1),
    }
    logger.info("Multi30k %s->%s: %s", src_lang, tgt_lang, info)
    return BenchData(
        batches,
        sources,
        tokenizer.vocab_size,
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.eos_id,
        f"Multi30k {src_lang}->{tgt_lang} train, joint BPE {tokenizer.vocab_size}",
        info,
    )


def synthetic_data(
    *,
    vocab_size: int = 64,
    num_batches: int = 4,
    batch_size: int = 4,
    src_len: int = 9,
    tgt_len: int = 8,
    num_sources: int = 8,
    seed: int = 0,
) -> BenchData:
    """Random ids with ragged lengths (ids 0-3 are pad/BOS/EOS/UNK, as in qkv's tokenizer)."""
    if vocab_size <= 4 or min(num_batches, batch_size, src_len, tgt_len) < 2:
        raise ValueError(
            f"need vocab_size > 4 and sizes >= 2, got vocab_size={vocab_size}, num_batches={num_batches}, "
            f"batch_size={batch_size}, src_len={src_len}, tgt_len={tgt_len}"
        )
    rng = random.Random(seed)

    def sentence(longest: int) -> list[int]:
        return [rng.randrange(4, vocab_size) for _ in range(rng.randint(max(1, longest // 2), longest - 1))]

    batches = [
        make_batch(
            [sentence(src_len) for _ in range(batch_size)],
            [sentence(tgt_len) for _ in range(batch_size)],
            pad_id=0,
            bos_id=1,
            eos_id=2,
        )
        for _ in range(num_batches)
    ]
    sources = [sentence(src_len) for _ in range(num_sources)]
    return BenchData(
        batches,
        sources,
        vocab_size,
        0,
        1,
        2,
        f"synthetic ids, vocabulary {vocab_size}",
        {"batches": num_batches, "batch_size": batch_size},
    )
