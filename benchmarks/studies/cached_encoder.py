"""How fast ``qkv prepare`` tokenizes real text in one worker: Multi30k's English, German and French
training sentences (29,000 each; German and French mostly not ASCII) through

- ``tokenizer``: the ``tokenizers`` library's own ``encode_batch`` on one thread (what a worker
  runs for a text the fast path does not take; ``TOKENIZERS_PARALLELISM=false`` as in the workers);
- ``ascii_fast_path``: :class:`~qkv.data.cached_encoder.CachedEncoder` with its Python split on ASCII
  texts only (the encoder before it took Latin-script text: every other text goes to the tokenizer);
- ``latin_fast_path``: the encoder as it is (ASCII and Latin-script texts split in Python).

Each measure is the median of ``--repeats`` runs over all of a language's sentences with a new
encoder (``cold``: every piece is new to its cache, as at the start of a corpus) and then again with
the same one (``warm``: the pieces cached, as deep into a large corpus). Every result is checked
against ``tokenizer.encode``. An 8k joint BPE learned on the three languages' training text.

    python benchmarks/studies/cached_encoder.py   # benchmarks/results/performance/cached_encoder_multi30k.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread, as a worker

from qkv.bench.provenance import write_result  # noqa: E402
from qkv.bench.results import add_result_options, check_result_file  # noqa: E402
from qkv.bench.timing import environment  # noqa: E402
from qkv.data import cached_encoder, resolve_multi30k  # noqa: E402
from qkv.data.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ASCII_ONLY = re.compile("[\x00-\x7f]*")


def encode_cold(tokenizer: Tokenizer, sentences: list[str]) -> object:
    """Encode ``sentences`` with a new CachedEncoder: the first pass, nothing cached yet."""
    return cached_encoder.CachedEncoder(tokenizer).encode(sentences)


def timed(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@contextlib.contextmanager
def fast_path(latin: bool):
    """The encoder's selection of texts it splits itself: as it is, or ASCII only (as before)."""
    saved = cached_encoder.LATIN_TEXT
    cached_encoder.LATIN_TEXT = saved if latin else ASCII_ONLY
    try:
        yield
    finally:
        cached_encoder.LATIN_TEXT = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache)")
    parser.add_argument("--repeats", type=int, default=3)
    add_result_options(parser, ROOT / "benchmarks" / "results" / "performance" / "cached_encoder_multi30k.json")
    args = parser.parse_args()
    check_result_file(parser, args)  # before any work
    folder = resolve_multi30k(args.data, download=False)  # --data, $QKV_DATA/multi30k or the cache
    texts = {}
    for lang in ("en", "de", "fr"):
        with gzip.open(folder / f"train.{lang}.gz", "rt", encoding="utf-8") as lines:
            texts[lang] = lines.read().splitlines()
    tokenizer = Tokenizer.train([t for lang in texts.values() for t in lang], vocab_size=8000)
    results = {}
    for lang, sentences in texts.items():
        expected = [tokenizer.encode(t) for t in sentences]
        n = len(sentences)
        row = {
            "sentences": n,
            "not_ascii": round(sum(not t.isascii() for t in sentences) / n, 3),
            "latin_path_share": round(
                sum(cached_encoder.LATIN_TEXT.fullmatch(t) is not None for t in sentences) / n, 3
            ),
        }
        row["tokenizer_s"] = timed(
            functools.partial(tokenizer.backend.encode_batch, sentences, add_special_tokens=False), args.repeats
        )
        for name, latin in (("ascii_fast_path", False), ("latin_fast_path", True)):
            with fast_path(latin):
                cold = timed(functools.partial(encode_cold, tokenizer, sentences), args.repeats)
                encoder = cached_encoder.CachedEncoder(tokenizer)
                encoder.encode(sentences)
                warm = timed(functools.partial(encoder.encode, sentences), args.repeats)
                ids, lengths = encoder.encode(sentences)
            if [p.tolist() for p in np.split(ids, np.cumsum(lengths)[:-1])] != expected:
                raise AssertionError(f"{name} differs from tokenizer.encode on {lang}")
            row[name] = {"cold_s": cold, "warm_s": warm}
        for name in ("ascii_fast_path", "latin_fast_path"):
            for kind in ("cold", "warm"):
                row[name][f"{kind}_sentences_per_s"] = round(len(sentences) / row[name][f"{kind}_s"])
        row["tokenizer_sentences_per_s"] = round(len(sentences) / row["tokenizer_s"])
        row["latin_over_ascii_warm"] = round(row["ascii_fast_path"]["warm_s"] / row["latin_fast_path"]["warm_s"], 2)
        row["latin_over_ascii_cold"] = round(row["ascii_fast_path"]["cold_s"] / row["latin_fast_path"]["cold_s"], 2)
        results[lang] = row
        print(lang, dict(row), flush=True)
    report = {
        "what": "CachedEncoder vs the tokenizers library on Multi30k training text, one thread",
        "command": "python benchmarks/cached_encoder.py",
        "vocab_size": tokenizer.vocab_size,
        "repeats": args.repeats,
        "languages": results,
        "machine": {**environment(), "load_average_end": list(os.getloadavg())},
    }
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
