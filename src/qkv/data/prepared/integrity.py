"""Checking that a prepared folder (:mod:`qkv.data.prepared`) holds what its manifest says: each
split's arrays fit together and the vocabulary (:func:`check_split_arrays`, a window at a time),
and every file has the manifest's SHA-256 (:func:`check_hashes`), the hashes kept in
``verified.json`` while the files are unchanged (:class:`HashCache`: trusted when a run starts,
never when it resumes)."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np

from qkv.data.prepared.format import PREPARE_AGAIN, SIDES
from qkv.runtime.fileio import read_json, write_json

logger = logging.getLogger(__name__)

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
    means hashing again. That is all an entry is trusted for, and anyone who can write the folder
    can write ``verified.json`` too (the changed file's new size and times beside the manifest's
    hash): so a run's start (or any check but a resume) trusts it, while a resume hashes every file
    from its contents (``trust=False``), a forged entry then counting for nothing. A file changed
    less than two seconds before it was hashed gets no entry: on a filesystem with coarse
    timestamps, a second change in the same tick would leave the times as they were (git's "racily
    clean" files). The cache only saves time: a missing, damaged or unwritable ``verified.json`` (a
    read-only folder) means hashing again, never an error.

    Args:
        folder: the prepared folder.
        keep: read and write ``verified.json`` (False: hash every time, write nothing).
        trust: use a kept hash instead of hashing its unchanged file (False: hash every file, and
            keep the hashes just computed).
    """

    def __init__(self, folder: Path, *, keep: bool = True, trust: bool = True) -> None:
        self.path, self.keep, self.trust, self.changed = Path(folder) / CACHE_FILE, keep, trust, False
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
        used only if it is that one: a kept hash can spare a hash, never condemn a file. Without
        ``trust``, always computed."""
        path = self.path.parent / name
        before = _identity(path)
        entry = self.entries.get(name)
        if (
            self.trust
            and isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and expected in (None, entry["sha256"])
            and all(entry.get(key) == value for key, value in before.items())
        ):
            return entry["sha256"]
        started = time.time_ns()
        digest = sha256_file(path)
        if self.keep and _identity(path) == before and before["mtime_ns"] < started - RACY_NS:
            fresh = {**before, "sha256": digest}
            # a resume hashes files whose entry is already this: verified.json is then left as it is
            self.changed = self.changed or entry != fresh
            self.entries[name] = fresh
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


def window(path: Path, dtype: np.dtype, start: int, count: int, width: int = 1) -> np.ndarray:
    """Rows ``[start, start + count)`` of an array file of ``width`` columns, memory-mapped
    read-only (mapped for this window alone: its pages leave the process with it)."""
    shape = (count,) if width == 1 else (count, width)
    if not count:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=start * width * dtype.itemsize, shape=shape)


def check_split_arrays(
    folder: Path,
    name: str,
    *,
    pairs: int,
    tokens: dict[str, int],
    ids_dtype: np.dtype,
    lengths_dtype: np.dtype,
    vocab_size: int,
    remedy: str = PREPARE_AGAIN,
) -> None:
    """Check the arrays of split ``name`` against each other and the vocabulary, a window at a
    time (so memory stays flat on any size): each side's offsets start at 0, never decrease and
    end at the number of ids in its ``.bin`` (``tokens[side]``); the length table holds the
    offsets' differences; every id is below ``vocab_size``. The hash (:func:`check_hashes`)
    catches any other change; these name what is wrong, where reading on would fail far from the
    cause.

    Raises:
        ValueError: one line naming the file, the pair or position, and ending with ``remedy``.
    """
    int64, n = np.dtype(np.int64), pairs
    table = folder / f"{name}.len"
    for column, side in enumerate(SIDES):
        index, ids = folder / f"{name}.{side}.idx", folder / f"{name}.{side}.bin"
        first, last = int(window(index, int64, 0, 1)[0]), int(window(index, int64, n, 1)[0])
        if first != 0:
            raise ValueError(f"{index}: the first offset is {first}, not 0; {remedy}")
        if last != tokens[side]:
            raise ValueError(f"{index}: the last offset is {last}, but {ids.name} holds {tokens[side]} ids; {remedy}")
        for start in range(0, n, SCAN_ITEMS):
            count = min(SCAN_ITEMS, n - start)
            steps = np.diff(window(index, int64, start, count + 1))
            if (steps < 0).any():
                k = int(np.argmax(steps < 0))
                raise ValueError(
                    f"{index}: the offsets go back at pair {start + k} (it would hold {int(steps[k])} ids); {remedy}"
                )
            lengths = window(table, lengths_dtype, start, count, 2)[:, column]
            if not np.array_equal(lengths, steps):
                k = int(np.argmax(lengths != steps))
                raise ValueError(
                    f"{table}: pair {start + k}'s {side} length is {int(lengths[k])}, but "
                    f"{index.name}'s offsets give {int(steps[k])}; {remedy}"
                )
        _check_ids(ids, index, ids_dtype, tokens[side], pairs, vocab_size, remedy)


def _check_ids(ids: Path, index: Path, dtype: np.dtype, count: int, pairs: int, vocab_size: int, remedy: str) -> None:
    """Every id of the ``.bin`` file ``ids`` is below ``vocab_size`` (an error names its pair, by ``index``)."""
    for start in range(0, count, SCAN_ITEMS):
        chunk = window(ids, dtype, start, min(SCAN_ITEMS, count - start))
        if int(chunk.max()) >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            pair = int(np.searchsorted(window(index, np.dtype(np.int64), 0, pairs + 1), at, side="right")) - 1
            raise ValueError(
                f"{ids}: id {int(chunk[at - start])} (position {at}, pair {pair}) is outside "
                f"the vocabulary of {vocab_size} ids; {remedy}"
            )


def check_hashes(
    folder: Path,
    expected: dict[str, str],
    *,
    cache: bool = True,
    trust_cache: bool = True,
    remedy: str = PREPARE_AGAIN,
) -> None:
    """Check that every file named in ``expected`` has its SHA-256 there, hashing it or using the
    hash kept in ``verified.json`` while the file is unchanged (see :class:`HashCache`).

    Args:
        folder: the prepared folder.
        expected: file name -> the SHA-256 it must have.
        cache: read and write ``verified.json``.
        trust_cache: use a kept hash for an unchanged file (False: hash every file from its
            contents, as a resume does, and keep the hashes found).
        remedy: what the error message tells the user to do.

    Raises:
        FileNotFoundError: a file missing.
        ValueError: one line naming the file that changed, and ending with ``remedy``.
    """
    hashes = HashCache(folder, keep=cache, trust=trust_cache)
    try:
        for file, want in expected.items():
            if not (folder / file).is_file():
                raise FileNotFoundError(f"{folder / file}: missing from the prepared folder {folder}")
            got = hashes.sha256(file, want)
            if got != want:
                raise ValueError(
                    f"{folder / file}: changed since it was prepared (SHA-256 {got[:12]}, the "
                    f"manifest's {want[:12]}); {remedy}"
                )
    finally:
        hashes.save()
