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
    verified.json        the files' SHA-256 as last checked, by size and times (a cache, written
                         when a run first verifies the folder; see HashCache)

A folder is built under a temporary name and renamed when whole (:func:`building_folder`), so a
crash never leaves a half-prepared folder that looks complete.

Before a run trains on a folder, and again when it resumes, :meth:`PreparedCorpus.verify` checks
that the data is what the manifest says: the offsets run from 0 to the end of the ids, the length
table agrees with them, every id is inside the vocabulary, and every file has the manifest's
SHA-256. Hashing reads every byte (about a second for WMT 2014's 4.5M pairs, 876 MiB, on a 2-core
EPYC), so the hashes are kept in ``verified.json`` beside the arrays (:class:`HashCache`), valid
while a file's size and times stay those recorded; the other checks run every time.

Training reads a pair with ``os.pread`` from the files every process shares in the page cache,
instead of through a memory map: a map's touched pages count in each process's resident memory
until the kernel reclaims them, which over an epoch of random batches is the whole corpus per
process; ``pread`` copies only the batch. :meth:`PreparedSplit.tokens` maps a whole array, for
inspection.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from qkv.data.parallel import ParallelText
from qkv.data.tokenizer import Tokenizer
from qkv.runtime.fileio import atomic_folder, read_json, write_json

logger = logging.getLogger(__name__)

MARKER, FORMAT = "qkv_prepared", 1
SIDES = ("src", "tgt")
ARRAY_DTYPES = ("uint16", "uint32")  # the types token_dtype and length_dtype choose
PREPARE_AGAIN = "the prepared folder is damaged: prepare it again (qkv prepare --overwrite)"


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
        names = split_files(split)
        self.files = {name: open(self.folder / name, "wb") for name in names}
        self.hashes = {name: hashlib.sha256() for name in names}
        self.pairs, self.tokens = 0, dict.fromkeys(SIDES, 0)
        for side in SIDES:
            self._write(f"{split}.{side}.idx", np.zeros(1, dtype=np.int64))

    def _write(self, name: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.files[name].write(data)
        self.hashes[name].update(data)

    def append(
        self,
        src_ids: np.ndarray,
        src_lengths: np.ndarray,
        tgt_ids: np.ndarray,
        tgt_lengths: np.ndarray,
        lines: np.ndarray,
    ) -> None:
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
            raise ValueError(
                f"a sentence of {int(table.max())} tokens does not fit the {self.lengths_dtype} length table"
            )
        self._write(f"{self.split}.len", table.astype(self.lengths_dtype))
        self._write(f"{self.split}.lines", np.asarray(lines, dtype=np.int64))
        self.pairs += len(lines)

    def close(self) -> dict:
        """Flush every file to disk; returns the split's counts and file hashes for the manifest."""
        for handle in self.files.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        return {
            "pairs": self.pairs,
            "src_tokens": self.tokens["src"],
            "tgt_tokens": self.tokens["tgt"],
            "sha256": {name: h.hexdigest() for name, h in self.hashes.items()},
        }


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
        raise ValueError(
            f"{out}: not a prepared folder (no manifest.json) and not empty; --overwrite only replaces "
            "a prepared folder"
        )


def folder_fingerprint(tokenizer_sha: str, splits: dict[str, dict]) -> str:
    """The manifest's fingerprint: a SHA-256 over the tokenizer's hash and each split's counts,
    types and file hashes, so that one string says whether two folders hold the same data."""
    text = json.dumps({"tokenizer": tokenizer_sha, "splits": splits}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(folder: Path, tokenizer: Tokenizer, splits: dict[str, dict], **info) -> dict:
    """Write ``tokenizer.json`` and, last, ``manifest.json`` with the fingerprint: a SHA-256 of
    the tokenizer and every array. Returns the manifest."""
    tokenizer.save(folder / "tokenizer.json")
    tokenizer_sha = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    fingerprint = folder_fingerprint(tokenizer_sha, splits)
    first = next(iter(splits.values()))
    manifest = {
        MARKER: FORMAT,
        "fingerprint": fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "ids_dtype": str(token_dtype(tokenizer.vocab_size)),
        "lengths_dtype": first["lengths_dtype"],
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": tokenizer_sha,
        "splits": splits,
        **info,
    }
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
            flat = [
                np.fromiter((i for s in ids for i in s), dtype=dtypes["ids_dtype"], count=int(n.sum()))
                for ids, n in zip((src, tgt), lengths)
            ]
            writer.append(flat[0], lengths[0], flat[1], lengths[1], np.asarray(lines, dtype=np.int64))
        finally:
            written[name] = {**writer.close(), "lengths_dtype": str(dtypes["lengths_dtype"])}
    return write_manifest(folder, tokenizer, written, **info)


# ------------------------------------------------------------------ checking a folder's files
SCAN_ITEMS = 2**20  # array elements mapped at a time when checking (8 MiB of offsets): memory stays flat
HASH_BLOCK = 2**20
RACY_NS = 2 * 10**9  # a file changed this recently is hashed but its hash is not kept (see HashCache)
CACHE_FILE, CACHE_FORMAT = "verified.json", 1


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file ``path``, read a block at a time."""
    digest, buffer = hashlib.sha256(), bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def _identity(path: Path) -> dict:
    """What a cached hash is valid for: the file's size, inode, mtime and ctime. A user can set a
    file's mtime back (``touch -d``) but not its ctime, which the kernel moves on every change."""
    stat = path.stat()
    return {"size": stat.st_size, "ino": stat.st_ino, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


class HashCache:
    """The SHA-256 of a prepared folder's files as last computed, kept in ``verified.json`` in the
    folder, so that a folder of gigabytes is hashed once rather than at every run start.

    An entry counts while its file's size, inode, mtime and ctime are those recorded; any change
    means hashing again. A file changed less than two seconds before it was hashed gets no entry:
    on a filesystem with coarse timestamps, a second change in the same tick would leave the times
    as they were (git's "racily clean" files). The cache only saves time: a missing, damaged or
    unwritable ``verified.json`` (a read-only folder) means hashing again, never an error.

    Args:
        folder: the prepared folder.
        keep: read and write ``verified.json`` (False: hash every time, write nothing).
    """

    def __init__(self, folder: Path, *, keep: bool = True) -> None:
        self.path, self.keep, self.changed = Path(folder) / CACHE_FILE, keep, False
        self.entries: dict = self._load() if keep else {}

    def _load(self) -> dict:
        try:
            data = read_json(self.path)
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None
        return dict(files) if isinstance(files, dict) else {}

    def sha256(self, name: str, expected: str | None = None) -> str:
        """The SHA-256 of the folder's file ``name``: the kept one while the file is unchanged, else
        computed (and kept unless the file changed just now). With ``expected``, a kept hash is
        used only if it is that one: a kept hash can spare a hash, never condemn a file."""
        path = self.path.parent / name
        before = _identity(path)
        entry = self.entries.get(name)
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and expected in (None, entry["sha256"])
            and all(entry.get(key) == value for key, value in before.items())
        ):
            return entry["sha256"]
        started = time.time_ns()
        digest = sha256_file(path)
        if self.keep and _identity(path) == before and before["mtime_ns"] < started - RACY_NS:
            self.entries[name] = {**before, "sha256": digest}
            self.changed = True
        elif self.entries.pop(name, None) is not None:
            self.changed = True
        return digest

    def save(self) -> None:
        """Write ``verified.json`` (atomically) if an entry changed; a folder that cannot be written
        to keeps no cache."""
        if not (self.keep and self.changed):
            return
        try:
            write_json(
                self.path,
                {
                    "format": CACHE_FORMAT,
                    "what": "SHA-256 of this prepared folder's files as last "
                    "computed, valid while a file's size, inode, mtime and ctime are these; deleting "
                    "this file only means hashing again",
                    "files": self.entries,
                },
            )
            self.changed = False
        except OSError as err:
            logger.info("%s: not kept (%s); the files will be hashed again next time", self.path, err)


def _window(path: Path, dtype: np.dtype, start: int, count: int, width: int = 1) -> np.ndarray:
    """Rows ``[start, start + count)`` of an array file of ``width`` columns, memory-mapped
    read-only (mapped for this window alone: its pages leave the process with it)."""
    shape = (count,) if width == 1 else (count, width)
    if not count:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=start * width * dtype.itemsize, shape=shape)


def _check_manifest(path: Path, manifest) -> None:
    """The fields a prepared folder is read by, with the types and values qkv prepare writes:
    ``ValueError`` naming the manifest and the field otherwise."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{path}: {field} {why}; {PREPARE_AGAIN}")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(manifest.get("fingerprint"), str):
        raise bad("fingerprint", "is missing")
    if not count(manifest.get("vocab_size")) or not manifest["vocab_size"]:
        raise bad("vocab_size", f"is {manifest.get('vocab_size')!r}, not a positive integer")
    if manifest.get("ids_dtype") not in ARRAY_DTYPES:
        raise bad("ids_dtype", f"is {manifest.get('ids_dtype')!r}, not one of {', '.join(ARRAY_DTYPES)}")
    tokenizer = manifest.get("tokenizer", "tokenizer.json")
    if not isinstance(tokenizer, str) or Path(tokenizer).name != tokenizer or tokenizer in ("", ".", ".."):
        raise bad("tokenizer", f"is {tokenizer!r}, not a file name in the folder")
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise bad("splits", "is missing or empty")
    for name, info in splits.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not isinstance(info, dict):
            raise bad(f"splits.{name}", "is not a split (a plain name with its counts)")
        for field in ("pairs", "src_tokens", "tgt_tokens"):
            if not count(info.get(field)):
                raise bad(f"splits.{name}.{field}", f"is {info.get(field)!r}, not a count")
        if info.get("lengths_dtype") not in ARRAY_DTYPES:
            raise bad(
                f"splits.{name}.lengths_dtype",
                f"is {info.get('lengths_dtype')!r}, not one of {', '.join(ARRAY_DTYPES)}",
            )
        hashes = info.get("sha256")
        missing = [f for f in split_files(name) if not isinstance(hashes, dict) or not isinstance(hashes.get(f), str)]
        if missing:
            raise bad(f"splits.{name}.sha256", f"lists no hash for {', '.join(missing)}")
    sources = manifest.get("sources")  # where each split's text came from (for messages); qkv always writes it
    if not isinstance(sources, dict) or not all(
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, (str, type(None))) for k, v in files.items())
        for files in sources.values()
    ):
        raise bad("sources", "is not an object of splits, each naming its source and target files")


def split_files(split: str) -> list[str]:
    """The array files of a split, in the order SplitWriter writes them."""
    return [f"{split}.{side}.{kind}" for side in SIDES for kind in ("bin", "idx")] + [f"{split}.len", f"{split}.lines"]


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
        self.num_tokens = {side: int(info[f"{side}_tokens"]) for side in SIDES}
        expected = {
            f"{name}.len": self.num_pairs * 2 * self.lengths_dtype.itemsize,
            f"{name}.lines": self.num_pairs * 8,
        }
        for side in SIDES:
            expected[f"{name}.{side}.bin"] = self.num_tokens[side] * self.ids_dtype.itemsize
            expected[f"{name}.{side}.idx"] = (self.num_pairs + 1) * 8
        for file, size in expected.items():
            path = folder / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing from the prepared folder {folder}")
            if path.stat().st_size != size:
                raise ValueError(
                    f"{path}: {path.stat().st_size} bytes, the manifest says {size}; the prepared folder "
                    "is damaged: prepare it again"
                )

    def __len__(self) -> int:
        return self.num_pairs

    def check(self, vocab_size: int, remedy: str = PREPARE_AGAIN) -> None:
        """Check the split's arrays against each other and the vocabulary, a window at a time (so
        memory stays flat on any size): each side's offsets start at 0, never decrease and end at
        the number of ids in its ``.bin``; the length table holds the offsets' differences; every
        id is below ``vocab_size``. The hash (:meth:`PreparedCorpus.verify`) catches any other
        change; these name what is wrong, where reading on would fail far from the cause.

        Raises:
            ValueError: one line naming the file, the pair or position, and ending with ``remedy``.
        """
        int64, n = np.dtype(np.int64), self.num_pairs
        table = self.folder / f"{self.name}.len"
        for column, side in enumerate(SIDES):
            index, ids = self.folder / f"{self.name}.{side}.idx", self.folder / f"{self.name}.{side}.bin"
            first, last = int(_window(index, int64, 0, 1)[0]), int(_window(index, int64, n, 1)[0])
            if first != 0:
                raise ValueError(f"{index}: the first offset is {first}, not 0; {remedy}")
            if last != self.num_tokens[side]:
                raise ValueError(
                    f"{index}: the last offset is {last}, but {ids.name} holds {self.num_tokens[side]} ids; {remedy}"
                )
            for start in range(0, n, SCAN_ITEMS):
                count = min(SCAN_ITEMS, n - start)
                steps = np.diff(_window(index, int64, start, count + 1))
                if (steps < 0).any():
                    k = int(np.argmax(steps < 0))
                    raise ValueError(
                        f"{index}: the offsets go back at pair {start + k} (it would hold {int(steps[k])} "
                        f"ids); {remedy}"
                    )
                lengths = _window(table, self.lengths_dtype, start, count, 2)[:, column]
                if not np.array_equal(lengths, steps):
                    k = int(np.argmax(lengths != steps))
                    raise ValueError(
                        f"{table}: pair {start + k}'s {side} length is {int(lengths[k])}, but "
                        f"{index.name}'s offsets give {int(steps[k])}; {remedy}"
                    )
            for start in range(0, self.num_tokens[side], SCAN_ITEMS):
                window = _window(ids, self.ids_dtype, start, min(SCAN_ITEMS, self.num_tokens[side] - start))
                if int(window.max()) >= vocab_size:
                    at = start + int(np.argmax(window >= vocab_size))
                    pair = int(np.searchsorted(_window(index, int64, 0, n + 1), at, side="right")) - 1
                    raise ValueError(
                        f"{ids}: id {int(window[at - start])} (position {at}, pair {pair}) is outside "
                        f"the vocabulary of {vocab_size} ids; {remedy}"
                    )

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
        _check_manifest(path, self.manifest)
        self.fingerprint: str = self.manifest["fingerprint"]

    def verify(self, vocab_size: int | None = None, *, cache: bool = True, remedy: str = PREPARE_AGAIN) -> None:
        """Check that the folder holds what its manifest says, before a run trains on it: the
        manifest's fingerprint is that of the hashes it lists; every split's files have the
        manifest's sizes and fit together (:meth:`PreparedSplit.check`, with ids below the smaller
        of the manifest's vocabulary and ``vocab_size``, the model's); the tokenizer and every array
        have the manifest's SHA-256. So a run whose recorded fingerprint equals this folder's trains
        on the very bytes it was started on.

        Args:
            vocab_size: the vocabulary the ids must fit (default: the manifest's).
            cache: keep the hashes in the folder's ``verified.json`` (:class:`HashCache`) and use
                them while the files are unchanged.
            remedy: what the error message tells the user to do.

        Raises:
            FileNotFoundError: a file missing.
            ValueError: one line naming the file that is not what the manifest says.
        """
        manifest, path = self.manifest, self.folder / "manifest.json"
        tokenizer = manifest.get("tokenizer", "tokenizer.json")
        expected = {tokenizer: manifest.get("tokenizer_sha256")}
        for name, info in manifest["splits"].items():
            expected.update({file: info["sha256"][file] for file in split_files(name)})
        if not isinstance(expected[tokenizer], str):
            raise ValueError(f"{path}: tokenizer_sha256 is missing; {remedy}")
        if folder_fingerprint(expected[tokenizer], manifest["splits"]) != self.fingerprint:
            raise ValueError(
                f"{path}: the fingerprint is not that of the hashes the manifest lists (the manifest "
                f"was edited); {remedy}"
            )
        limit = manifest["vocab_size"] if vocab_size is None else min(vocab_size, manifest["vocab_size"])
        for name in manifest["splits"]:
            split = self.split(name)
            try:
                split.check(limit, remedy)
            finally:
                split.close()
        hashes = HashCache(self.folder, keep=cache)
        try:
            for file, want in expected.items():
                if not (self.folder / file).is_file():
                    raise FileNotFoundError(f"{self.folder / file}: missing from the prepared folder {self.folder}")
                got = hashes.sha256(file, want)
                if got != want:
                    raise ValueError(
                        f"{self.folder / file}: changed since it was prepared (SHA-256 {got[:12]}, the "
                        f"manifest's {want[:12]}); {remedy}"
                    )
        finally:
            hashes.save()

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.folder / self.manifest.get("tokenizer", "tokenizer.json"))

    def has(self, split: str) -> bool:
        return split in self.manifest["splits"]

    def split(self, name: str) -> PreparedSplit:
        """The split ``name`` (``train`` or ``valid``). Raises ``ValueError`` when there is none."""
        if not self.has(name):
            raise ValueError(f"{self.folder}: no {name!r} split (it has {', '.join(self.manifest['splits'])})")
        return PreparedSplit(
            self.folder,
            name,
            self.manifest["splits"][name],
            np.dtype(self.manifest["ids_dtype"]),
            self.manifest.get("sources", {}).get(name, {}),
        )

    def text(self, name: str, tokenizer: Tokenizer | None = None) -> ParallelText:
        """A split's sentences as text (decoded: byte-level BPE gives back the text exactly), for
        validation and scoring. Holds the whole split in memory: meant for the validation set."""
        tokenizer = tokenizer or self.tokenizer()
        split = self.split(name)
        src, tgt = split.read(range(len(split)))
        source = split.source
        return ParallelText(
            [tokenizer.decode(x) for x in src],
            [tokenizer.decode(x) for x in tgt],
            source.get("src", ""),
            source.get("tgt", ""),
        )
