"""Data for translation: parallel text (and Multi30k), the built-in date task, the BPE tokenizer
and token-count batching."""

from qkv.data.batching import Batch, make_batch, pad_sequences, token_batches
from qkv.data.parallel import (
    ParallelText,
    load_multi30k,
    read_lines,
    read_parallel,
    resolve_multi30k,
)
from qkv.data.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "ParallelText",
    "Tokenizer",
    "load_multi30k",
    "make_batch",
    "pad_sequences",
    "read_lines",
    "read_parallel",
    "resolve_multi30k",
    "token_batches",
]
