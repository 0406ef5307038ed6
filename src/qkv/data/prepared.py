"""A prepared folder: a tokenized parallel corpus on disk, read a batch at a time.

Made once by ``qkv prepare`` (:mod:`qkv.data.preparing`), or by ``qkv train`` inside a run folder;
read by every training process, which then holds O(batch) token data, not O(corpus). The layout is
that of fairseq's indexed datasets and nanoGPT's ``.bin`` files, one set per split (``train``,
``valid``)::

    manifest.json        counts, dtypes, the tokenizer, where the text came from, the lines
                         dropped (and why), a fingerprint; written last
    tokenizer.json       the shared BPE tokenizer
    train.src.bin        every source sentence's ids end to end (uint16, or uint32 for
    train.tgt.bin        vocabularies over 65,536), no BOS/EOS
    train.src.idx        int64 offsets into the .bin: sentence i is [idx[i], idx[i+1])
    train.tgt.idx
    train.len            (pairs, 2) token counts (source, target): what length bucketing reads
    train.lines          int64 line number of each pair in the text files (for messages)

A folder is built under a temporary name and renamed when whole (:func:`building_folder`), so a
crash never leaves a half-prepared folder that looks complete.

Training reads a pair with ``os.pread`` from the files every process shares in the page cache,
instead of through a memory map: a map's touched pages count in each process's resident memory
until the kernel reclaims them, which over an epoch of random batches is the whole corpus per
process; ``pread`` copies only the batch. :meth:`PreparedSplit.tokens` maps a whole array, for
inspection.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from qkv.data.parallel import ParallelText
from qkv.data.tokenizer import Tokenizer
from qkv.fileio import atomic_folder, read_json, write_json

MARKER, FORMAT = "qkv_prepared", 1
SIDES = ("src", "tgt")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def length_dtype(longest: int) -> np.dtype:
    return np.dtype(np.uint16 if longest < 2**16 else np.uint32)


def is_prepared_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete prepared corpus (its manifest, marked)."""
    try:
        return json.loads((Path(folder) / "manifest.json").read_text(encoding="utf-8")).get(MARKER) == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class SplitWriter:
    """Appends tokenized pairs to one split's files (in a folder being built), hashing as it writes.

    Args:
        folder: the folder being built.
        split: ``train`` or ``valid``.
        ids_dtype: the id arrays' type (:func:`token_dtype`).
        lengths_dtype: the length table's type (:func:`length_dtype` of the longest sentence allowed).
    """

    def __init__(self, folder: Path, split: str, *, ids_dtype, lengths_dtype) -> None:
        self.folder, self.split = Path(folder), split
        self.ids_dtype, self.lengths_dtype = np.dtype(ids_dtype), np.dtype(lengths_dtype)
        names = [f"{split}.{side}.{kind}" for side in SIDES for kind in ("bin", "idx")] + [f"{split}.len",
                                                                                          f"{split}.lines"]
        self.files = {name: open(self.folder / name, "wb") for name in names}
        self.hashes = {name: hashlib.sha256() for name in names}
        self.pairs, self.tokens = 0, {side: 0 for side in SIDES}
        for side in SIDES:
            self._write(f"{split}.{side}.idx", np.zeros(1, dtype=np.int64))

    def _write(self, name: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.files[name].write(data)
        self.hashes[name].update(data)

    def append(self, src_ids: np.ndarray, src_lengths: np.ndarray, tgt_ids: np.ndarray, tgt_lengths: np.ndarray,
               lines: np.ndarray) -> None:
        """Add pairs: each side's ids end to end and each sentence's length, and their line numbers."""
        if not len(lines):
            return
        for side, ids, lengths in (("src", src_ids, src_lengths), ("tgt", tgt_ids, tgt_lengths)):
            if int(np.sum(lengths)) != len(ids):
                raise ValueError(f"{side}: {len(ids)} ids but the lengths add up to {int(np.sum(lengths))}")
            self._write(f"{self.split}.{side}.bin", np.asarray(ids, dtype=self.ids_dtype))
            self._write(f"{self.split}.{side}.idx", self.tokens[side] + np.cumsum(lengths, dtype=np.int64))
            self.tokens[side] += len(ids)
        table = np.stack([np.asarray(src_lengths), np.asarray(tgt_lengths)], axis=1)
        if table.size and int(table.max()) > np.iinfo(self.lengths_dtype).max:
            raise ValueError(f"a sentence of {int(table.max())} tokens does not fit the {self.lengths_dtype} length table")
        self._write(f"{self.split}.len", table.astype(self.lengths_dtype))
        self._write(f"{self.split}.lines", np.asarray(lines, dtype=np.int64))
        self.pairs += len(lines)

    def close(self) -> dict:
        """Flush every file to disk; returns the split's counts and file hashes for the manifest."""
        for handle in self.files.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        return {"pairs": self.pairs, "src_tokens": self.tokens["src"], "tgt_tokens": self.tokens["tgt"],
                "sha256": {name: h.hexdigest() for name, h in self.hashes.items()}}


@contextmanager
def building_folder(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; when the block succeeds (having written
    ``manifest.json`` last), rename it to ``out``. On any exception, or a kill, nothing named
    ``out`` appears: the temporary folder (``.<name>.partial-*``) is removed, or cleared by the
    next build of ``out``. ``overwrite`` replaces an existing prepared folder, only once the new
    one is whole.

    Raises:
        ValueError: ``out`` exists (without ``overwrite``, or not a prepared folder).
    """
    out = Path(out)
    check_output_folder(out, overwrite=overwrite)
    with atomic_folder(out, tag="partial") as tmp:
        yield tmp
        if not is_prepared_folder(tmp):
            raise RuntimeError(f"{tmp}: no manifest written; the folder is not complete")


def check_output_folder(out: Path, *, overwrite: bool) -> None:
    """Refuse an ``out`` that exists, unless ``overwrite`` and it is a prepared folder (or empty)."""
    if not out.exists():
        return
    if not out.is_dir() or out.is_symlink():
        raise ValueError(f"{out}: exists and is not a folder")
    if not overwrite:
        raise ValueError(f"{out}: exists; pass --overwrite to replace it, or choose another --out")
    if not (is_prepared_folder(out) or not any(out.iterdir())):
        raise ValueError(f"{out}: not a prepared folder (no manifest.json) and not empty; --overwrite only replaces "
                         "a prepared folder")


def write_manifest(folder: Path, tokenizer: Tokenizer, splits: dict[str, dict], **info) -> dict:
    """Write ``tokenizer.json`` and, last, ``manifest.json`` with the fingerprint: a SHA-256 of
    the tokenizer and every array. Returns the manifest."""
    tokenizer.save(folder / "tokenizer.json")
    tokenizer_sha = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    fingerprint = hashlib.sha256(json.dumps({"tokenizer": tokenizer_sha, "splits": splits},
                                            sort_keys=True).encode()).hexdigest()
    first = next(iter(splits.values()))
    manifest = {MARKER: FORMAT, "fingerprint": fingerprint, "vocab_size": tokenizer.vocab_size,
                "ids_dtype": str(token_dtype(tokenizer.vocab_size)), "lengths_dtype": first["lengths_dtype"],
                "tokenizer": "tokenizer.json", "tokenizer_sha256": tokenizer_sha, "splits": splits, **info}
    write_json(folder / "manifest.json", manifest)
    return manifest


def write_token_lists(folder: Path, tokenizer: Tokenizer, splits: dict[str, tuple], **info) -> dict:
    """Write a prepared folder's files into ``folder`` (one being built) from token lists in
    memory: ``splits[name] = (source ids, target ids, line numbers)``. Returns the manifest."""
    longest = max((len(x) for src, tgt, _ in splits.values() for x in (*src, *tgt)), default=0)
    dtypes = dict(ids_dtype=token_dtype(tokenizer.vocab_size), lengths_dtype=length_dtype(longest))
    written = {}
    for name, (src, tgt, lines) in splits.items():
        writer = SplitWriter(folder, name, **dtypes)
        try:
            lengths = [np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) for ids in (src, tgt)]
            flat = [np.fromiter((i for s in ids for i in s), dtype=dtypes["ids_dtype"], count=int(n.sum()))
                    for ids, n in zip((src, tgt), lengths)]
            writer.append(flat[0], lengths[0], flat[1], lengths[1], np.asarray(lines, dtype=np.int64))
        finally:
            written[name] = {**writer.close(), "lengths_dtype": str(dtypes["lengths_dtype"])}
    return write_manifest(folder, tokenizer, written, **info)


class PreparedSplit:
    """One split of a prepared folder, read a few pairs at a time (see the module docstring).

    Attributes:
        source: where its text came from (``{"src": path, "tgt": path}`` when known), for messages.
    """

    def __init__(self, folder: Path, name: str, info: dict, ids_dtype: np.dtype, source: dict) -> None:
        self.folder, self.name, self.source = folder, name, source
        self.num_pairs = int(info["pairs"])
        self.ids_dtype, self.lengths_dtype = np.dtype(ids_dtype), np.dtype(info["lengths_dtype"])
        self._fds: dict[str, int] = {}
        self._pid = None
        expected = {f"{name}.len": self.num_pairs * 2 * self.lengths_dtype.itemsize,
                    f"{name}.lines": self.num_pairs * 8}
        for side in SIDES:
            expected[f"{name}.{side}.bin"] = int(info[f"{side}_tokens"]) * self.ids_dtype.itemsize
            expected[f"{name}.{side}.idx"] = (self.num_pairs + 1) * 8
        for file, size in expected.items():
            path = folder / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing from the prepared folder {folder}")
            if path.stat().st_size != size:
                raise ValueError(f"{path}: {path.stat().st_size} bytes, the manifest says {size}; the prepared folder "
                                 "is damaged: prepare it again")

    def __len__(self) -> int:
        return self.num_pairs

    def _fd(self, file: str) -> int:
        if self._pid != os.getpid():  # descriptors are not shared with a forked process
            self._fds, self._pid = {}, os.getpid()
        if file not in self._fds:
            self._fds[file] = os.open(self.folder / file, os.O_RDONLY)
        return self._fds[file]

    def _read(self, file: str, dtype: np.dtype, start: int, count: int) -> np.ndarray:
        size = count * dtype.itemsize
        data = os.pread(self._fd(file), size, start * dtype.itemsize)
        if len(data) != size:
            raise ValueError(f"{self.folder / file}: cut short (read {len(data)} of {size} bytes)")
        return np.frombuffer(data, dtype=dtype)

    def lengths(self) -> np.ndarray:
        """``(pairs, 2)`` token counts (source, target), without BOS/EOS, in memory."""
        return np.fromfile(self.folder / f"{self.name}.len", dtype=self.lengths_dtype).reshape(-1, 2)

    def ids(self, side: str, index: int) -> list[int]:
        """The ids of sentence ``index`` of ``side`` (``src`` or ``tgt``)."""
        if not 0 <= index < self.num_pairs:
            raise IndexError(f"pair {index} of a split of {self.num_pairs}")
        start, end = self._read(f"{self.name}.{side}.idx", np.dtype(np.int64), index, 2).tolist()
        return self._read(f"{self.name}.{side}.bin", self.ids_dtype, start, end - start).tolist()

    def read(self, indices) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs ``indices``."""
        return [self.ids("src", i) for i in indices], [self.ids("tgt", i) for i in indices]

    def where(self, index: int) -> str:
        """``file:line`` of pair ``index`` in the text it was prepared from."""
        line = int(self._read(f"{self.name}.lines", np.dtype(np.int64), index, 1)[0])
        return f"{self.source.get('src', 'source')}:{line} / {self.source.get('tgt', 'target')}:{line}"

    def tokens(self, side: str) -> np.ndarray:
        """All of ``side``'s ids end to end, memory-mapped read-only (for inspection)."""
        path = self.folder / f"{self.name}.{side}.bin"
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=self.ids_dtype)
        return np.memmap(path, dtype=self.ids_dtype, mode="r")

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class PreparedCorpus:
    """A prepared folder, opened: its manifest, tokenizer and splits.

    Raises:
        FileNotFoundError: no such folder, or not a complete prepared folder.
        ValueError: a damaged manifest or array.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.is_file():
            what = "no such folder" if not self.folder.exists() else "not a prepared folder (no manifest.json)"
            raise FileNotFoundError(f"{self.folder}: {what}; make one with qkv prepare")
        self.manifest = read_json(path)
        if not isinstance(self.manifest, dict) or self.manifest.get(MARKER) != FORMAT:
            raise ValueError(f"{path}: not a qkv prepared-folder manifest (format {FORMAT})")
        self.fingerprint: str = self.manifest["fingerprint"]

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.folder / self.manifest.get("tokenizer", "tokenizer.json"))

    def has(self, split: str) -> bool:
        return split in self.manifest["splits"]

    def split(self, name: str) -> PreparedSplit:
        """The split ``name`` (``train`` or ``valid``). Raises ``ValueError`` when there is none."""
        if not self.has(name):
            raise ValueError(f"{self.folder}: no {name!r} split (it has {', '.join(self.manifest['splits'])})")
        return PreparedSplit(self.folder, name, self.manifest["splits"][name], np.dtype(self.manifest["ids_dtype"]),
                             self.manifest.get("sources", {}).get(name, {}))

    def text(self, name: str, tokenizer: Tokenizer | None = None) -> ParallelText:
        """A split's sentences as text (decoded: byte-level BPE gives back the text exactly), for
        validation and scoring. Holds the whole split in memory: meant for the validation set."""
        tokenizer = tokenizer or self.tokenizer()
        split = self.split(name)
        src, tgt = split.read(range(len(split)))
        source = split.source
        return ParallelText([tokenizer.decode(x) for x in src], [tokenizer.decode(x) for x in tgt],
                            source.get("src", ""), source.get("tgt", ""))
