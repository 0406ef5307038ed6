"""Preparing a parallel corpus of any size: text files (plain or ``.gz``) in, a prepared folder
(:mod:`qkv.data.prepared`) out, streaming, on several processes.

1. Count each file's lines (misaligned files are an error before any work: a missing line
   shifts every pair after it, and qkv never guesses an alignment).
2. Learn the shared BPE tokenizer on an even sample: every k-th pair, at most ``tokenizer_sample``
   pairs (or use a given ``tokenizer.json``).
3. Tokenize in chunks on ``workers`` processes (:class:`~qkv.data.cached_encoder.CachedEncoder`),
   appending to the split's arrays in order. A pair with an empty side, a side that is not UTF-8,
   or a side longer than ``max_len`` tokens with its BOS/EOS is left out and counted; the manifest
   lists the first few as ``file:line: why``.

Memory is bounded by the chunks in flight and the encoders' piece caches, not by the corpus.
"""

from __future__ import annotations

import gzip
import io
import logging
import math
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from qkv.data.prepared.format import length_dtype, token_dtype
from qkv.data.prepared.workers import Encoders, line_text
from qkv.data.prepared.writer import SplitWriter, building_folder, check_output_folder, write_manifest
from qkv.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REASONS = {"empty": "empty line", "not_utf8": "not UTF-8", "over_long": "too long"}
LISTED = 20  # bad lines listed by file:line in the manifest (all are counted)


def open_text(path: Path) -> io.BufferedIOBase:
    """A binary handle on ``path``, decompressing ``.gz``."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115 - the caller's with-block closes it


def count_lines(path: Path, block: int = 16 * 2**20) -> int:
    """Lines in ``path`` (a last line without its newline counts). Raises ``ValueError`` for a
    file that cannot be read (e.g. a truncated ``.gz``) or is empty."""
    lines, last = 0, b"\n"
    try:
        with open_text(path) as handle:
            while data := handle.read(block):
                lines += data.count(b"\n")
                last = data[-1:]
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: cannot read ({err})") from err
    lines += last != b"\n"
    if not lines:
        raise ValueError(f"{path}: file is empty")
    return lines


def check_aligned(src: Path, tgt: Path) -> int:
    """The number of lines two parallel files share; ``ValueError`` naming both when they differ."""
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        shorter, n = (src, n_src) if n_src < n_tgt else (tgt, n_tgt)
        raise ValueError(
            f"misaligned parallel files: {src} has {n_src:,} lines, {tgt} has {n_tgt:,} ({shorter} ends "
            f"at line {n:,}; line {n + 1:,} of the other has no partner): fix the files, qkv never "
            "guesses an alignment"
        )
    return n_src


def sampled_sentences(src: Path, tgt: Path, stride: int) -> Iterator[str]:
    """Source and target text of every ``stride``-th pair whose sides are both usable."""
    with open_text(src) as a, open_text(tgt) as b:
        for raw_src, raw_tgt in islice(zip(a, b), 0, None, stride):
            src_text, tgt_text = line_text(raw_src), line_text(raw_tgt)
            if src_text is not None and tgt_text is not None and src_text.strip() and tgt_text.strip():
                yield src_text
                yield tgt_text


def _chunks(src: Path, tgt: Path, chunk_pairs: int) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    with open_text(src) as a, open_text(tgt) as b:
        first = 1
        while src_lines := list(islice(a, chunk_pairs)):
            tgt_lines = list(islice(b, len(src_lines)))
            yield first, src_lines, tgt_lines
            first += len(src_lines)


def prepare_corpus(
    train_src: str | Path,
    train_tgt: str | Path,
    out: str | Path,
    *,
    val_src: str | Path | None = None,
    val_tgt: str | Path | None = None,
    vocab_size: int = 8000,
    tokenizer: str | Path | None = None,
    tokenizer_sample: int = 1_000_000,
    max_len: int = 256,
    workers: int = 1,
    chunk_pairs: int = 20_000,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize a parallel corpus into the prepared folder ``out`` (see the module docstring).

    Args:
        train_src, train_tgt: line-aligned training files (``.gz`` is decompressed).
        out: the prepared folder to create.
        val_src, val_tgt: validation files (optional; both or neither).
        vocab_size: the BPE vocabulary to learn (with the 256 bytes and 4 specials).
        tokenizer: a ``tokenizer.json`` to use instead of learning one.
        tokenizer_sample: learn the tokenizer on at most this many pairs, spread evenly (0: all).
        max_len: longest sentence kept, in tokens with its BOS/EOS (the model's ``max_len``).
        workers: processes that tokenize.
        chunk_pairs: pairs per unit of work.
        overwrite: replace ``out`` if it is a prepared folder.
        progress: progress bars.

    Returns:
        the manifest written (``manifest.json``).

    Raises:
        FileNotFoundError / ValueError: a missing, unreadable, empty or misaligned file, a bad
            option, or no usable pair, before ``out`` is written.
    """
    paths = {"train": (Path(train_src), Path(train_tgt))}
    if bool(val_src) != bool(val_tgt):
        raise ValueError("give both --val-src and --val-tgt, or neither")
    if val_src and val_tgt:
        paths["valid"] = (Path(val_src), Path(val_tgt))
    _check_numbers(vocab_size, max_len, workers, tokenizer_sample, chunk_pairs)
    out = Path(out)
    check_output_folder(out, overwrite=overwrite)
    _check_inputs([p for pair in paths.values() for p in pair] + ([Path(tokenizer)] if tokenizer else []), out)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    lines = {split: check_aligned(*pair) for split, pair in paths.items()}
    seconds["count_lines"] = time.perf_counter() - start

    start = time.perf_counter()
    if tokenizer:
        tok = Tokenizer.load(tokenizer)
        tokenizer_info: dict[str, Any] = {"given": str(Path(tokenizer).resolve())}
    else:
        tok, tokenizer_info = _learn_tokenizer(*paths["train"], lines["train"], vocab_size, tokenizer_sample, progress)
    seconds["tokenizer"] = time.perf_counter() - start

    return _tokenize_into(
        out,
        tok,
        paths,
        lines,
        max_len=max_len,
        workers=workers,
        chunk_pairs=chunk_pairs,
        overwrite=overwrite,
        progress=progress,
        tokenizer_source=tokenizer_info,
        seconds=seconds,
    )


def _tokenize_into(
    out: Path,
    tokenizer: Tokenizer,
    paths: dict[str, tuple[Path, Path]],
    lines: dict[str, int],
    *,
    max_len: int,
    workers: int,
    chunk_pairs: int,
    overwrite: bool,
    progress: bool,
    tokenizer_source: dict[str, Any],
    seconds: dict[str, float],
) -> dict:
    """Tokenize each split of ``paths`` (with ``lines`` pairs) on ``workers`` processes into the
    prepared folder ``out``, built under a temporary name, and write its manifest last. Returns the
    manifest."""
    start = time.perf_counter()
    dtypes = dict(ids_dtype=token_dtype(tokenizer.vocab_size), lengths_dtype=length_dtype(max_len))
    report: dict[str, dict] = {}
    encoders = Encoders(tokenizer, max_len, workers)
    try:
        with building_folder(out, overwrite=overwrite) as folder:
            for split, (src, tgt) in paths.items():
                report[split] = _write_split(
                    folder, split, src, tgt, encoders, dtypes, lines[split], chunk_pairs, progress
                )
            seconds["tokenize"] = time.perf_counter() - start
            sources = {
                split: {"src": str(src.resolve()), "tgt": str(tgt.resolve())} for split, (src, tgt) in paths.items()
            }
            manifest = write_manifest(
                folder,
                tokenizer,
                {split: r.pop("written") for split, r in report.items()},
                sources=sources,
                lines=lines,
                dropped={split: r["dropped"] for split, r in report.items()},
                dropped_first={split: r["listed"] for split, r in report.items()},
                max_len=max_len,
                tokenizer_source=tokenizer_source,
                workers=workers,
                seconds={k: round(v, 2) for k, v in seconds.items()},
            )
    finally:
        encoders.close()
    return manifest


def _check_numbers(vocab_size: int, max_len: int, workers: int, tokenizer_sample: int, chunk_pairs: int) -> None:
    """prepare_corpus's numeric options: integers at or above their least value."""
    for name, value, low in (
        ("--vocab-size", vocab_size, 260),
        ("--max-len", max_len, 3),
        ("--workers", workers, 1),
        ("--tokenizer-sample", tokenizer_sample, 0),
        ("chunk_pairs", chunk_pairs, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if max_len >= 2**32:
        raise ValueError(f"--max-len must be below 2**32, got {max_len}")


def _check_inputs(paths: list[Path], out: Path) -> None:
    """Every input file exists, and none lies inside ``out``, which ``--overwrite`` would replace."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        if out.exists() and out.resolve() in path.resolve().parents:
            raise ValueError(f"{path} lies inside {out}, which --overwrite would replace; choose another --out")


def _learn_tokenizer(
    src: Path, tgt: Path, pairs: int, vocab_size: int, tokenizer_sample: int, progress: bool
) -> tuple[Tokenizer, dict[str, Any]]:
    """The shared BPE tokenizer learned on an even sample of the training pairs (every k-th, at most
    ``tokenizer_sample`` of them; 0: all), and the manifest's record of how it was learned."""
    stride = max(1, math.ceil(pairs / tokenizer_sample)) if tokenizer_sample else 1
    sample = math.ceil(pairs / stride)
    logger.info(
        "learning a %d-token BPE vocabulary on %s of %s pairs (every %s)",
        vocab_size,
        f"{sample:,}",
        f"{pairs:,}",
        "one" if stride == 1 else f"{stride}th",
    )
    sentences = tqdm(
        sampled_sentences(src, tgt, stride),
        total=2 * sample,
        desc="learning BPE",
        unit="sentences",
        disable=not progress,
        dynamic_ncols=True,
    )
    tokenizer = Tokenizer.train(sentences, vocab_size=vocab_size)
    return tokenizer, {"learned_on_pairs": sample, "every": stride, "vocab_size_asked": vocab_size}


def _write_split(
    folder: Path,
    split: str,
    src: Path,
    tgt: Path,
    encoders: Encoders,
    dtypes: dict,
    total: int,
    chunk_pairs: int,
    progress: bool,
) -> dict:
    writer = SplitWriter(folder, split, **dtypes)
    dropped, read = dict.fromkeys(REASONS, 0), 0
    listed: list[str] = []
    try:
        with tqdm(
            total=total,
            desc=f"tokenizing {split}",
            unit="pairs",
            unit_scale=True,
            disable=not progress,
            dynamic_ncols=True,
        ) as bar:
            for result in encoders.map(_chunks(src, tgt, chunk_pairs)):
                writer.append(
                    result["src_ids"], result["src_len"], result["tgt_ids"], result["tgt_len"], result["lines"]
                )
                for reason, side, line, detail in result["bad"]:
                    dropped[reason] += 1
                    if len(listed) < LISTED:
                        where = f"{(src, tgt)[side]}:{line}: {REASONS[reason]}" + (f" ({detail})" if detail else "")
                        listed.append(where)
                        logger.warning("left out %s", where)
                read += result["read"]
                bar.update(result["read"])
    finally:
        written = writer.close()
    if read != total:
        raise ValueError(f"{src} / {tgt}: read {read:,} pairs, counted {total:,} lines: did a file change meanwhile?")
    if not written["pairs"]:
        raise ValueError(f"{src} / {tgt}: none of the {total:,} pairs is usable ({dropped}); nothing prepared")
    if sum(dropped.values()):
        logger.warning(
            "%s: left out %s of %s pairs (%s)",
            split,
            f"{sum(dropped.values()):,}",
            f"{total:,}",
            ", ".join(f"{n:,} {REASONS[r]}" for r, n in dropped.items() if n),
        )
    return {"written": {**written, "lengths_dtype": str(dtypes["lengths_dtype"])}, "dropped": dropped, "listed": listed}
