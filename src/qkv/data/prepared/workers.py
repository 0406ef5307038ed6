"""Tokenizing a corpus's chunks for :mod:`qkv.data.prepared.preparing`: what one chunk of pairs becomes
(:func:`encode_chunk`: checked, tokenised, length-filtered), and the processes that do it in
order (:class:`Encoders`)."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from qkv.data.cached_encoder import CachedEncoder
from qkv.data.prepared.format import token_dtype
from qkv.data.tokenizer import Tokenizer


def line_text(raw: bytes) -> str | None:
    """A line's text as :func:`qkv.data.parallel.read_lines` reads it, or None if it is not UTF-8."""
    try:
        return raw.rstrip(b"\n").decode("utf-8").rstrip("\r")
    except UnicodeDecodeError:
        return None


_WORKER: dict = {}


def _start_worker(tokenizer_json: str, max_len: int) -> None:
    from tokenizers import Tokenizer as Backend

    tokenizer = Tokenizer(Backend.from_str(tokenizer_json))
    _WORKER.update(encoder=CachedEncoder(tokenizer, dtype=token_dtype(tokenizer.vocab_size)), max_len=max_len)


def encode_chunk(first_line: int, src_lines: list[bytes], tgt_lines: list[bytes]) -> dict:
    """Check, tokenize and length-filter one chunk of pairs (in a worker, or in-process).

    Returns:
        the kept pairs' ids end to end and lengths per side, their line numbers, and the bad
        pairs as ``(reason, side 0/1, line, detail)``.
    """
    encoder, max_len = _WORKER["encoder"], _WORKER["max_len"]
    src_texts: list[str] = []
    tgt_texts: list[str] = []
    numbers: list[int] = []
    bad: list[tuple[str, int, int, str]] = []
    for line, raw_pair in enumerate(zip(src_lines, tgt_lines), start=first_line):
        texts = [line_text(raw) for raw in raw_pair]
        for side, text in enumerate(texts):
            if text is None:
                bad.append(("not_utf8", side, line, ""))
                break
            if not text.strip():
                bad.append(("empty", side, line, ""))
                break
        else:  # both sides are text (a None side broke out of the loop above)
            src_texts.append(texts[0] or "")
            tgt_texts.append(texts[1] or "")
            numbers.append(line)
    src_ids, src_len = encoder.encode(src_texts)
    tgt_ids, tgt_len = encoder.encode(tgt_texts)
    keep = (src_len + 1 <= max_len) & (tgt_len + 1 <= max_len)  # + EOS; BOS + target
    lines = np.asarray(numbers, dtype=np.int64)
    if not keep.all():
        for i in np.flatnonzero(~keep).tolist():
            side = 0 if src_len[i] >= tgt_len[i] else 1
            n = int((src_len, tgt_len)[side][i])
            bad.append(("over_long", side, int(lines[i]), f"{n} tokens + 1 > --max-len {max_len}"))
        src_ids, tgt_ids = src_ids[np.repeat(keep, src_len)], tgt_ids[np.repeat(keep, tgt_len)]
        src_len, tgt_len, lines = src_len[keep], tgt_len[keep], lines[keep]
    return {
        "src_ids": src_ids,
        "src_len": src_len,
        "tgt_ids": tgt_ids,
        "tgt_len": tgt_len,
        "lines": lines,
        "bad": sorted(bad, key=lambda b: b[2]),
        "read": len(src_lines),
    }


class Encoders:
    """``workers`` forked processes encoding chunks (results in order, a few chunks in flight),
    or the calling process alone when ``workers == 1``."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, workers: int) -> None:
        self.workers, self.pool = workers, None
        args = (tokenizer.backend.to_str(), max_len)
        if workers == 1:
            _start_worker(*args)
            return
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        # the tokenizers library warns in a forked child when its threads ran in the parent, unless
        # told how to behave; each worker encodes on one thread (the workers are the parallelism)
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self.pool = multiprocessing.get_context(method).Pool(workers, initializer=_start_worker, initargs=args)
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous

    def map(self, chunks: Iterable[tuple[int, list[bytes], list[bytes]]]) -> Iterator[dict]:
        """Each chunk's encoded arrays, in the chunks' order (in this process when there is no pool)."""
        if self.pool is None:
            yield from (encode_chunk(*chunk) for chunk in chunks)
            return
        pending: deque = deque()
        for chunk in chunks:
            pending.append(self.pool.apply_async(encode_chunk, chunk))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        """Stop the worker processes and clear the in-process encoder's cache."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        _WORKER.clear()  # the in-process encoder's piece cache
