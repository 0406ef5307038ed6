"""Reading a prepared folder (:mod:`qkv.data.prepared`): :class:`PreparedCorpus` and its splits,
read a batch at a time with ``os.pread``, checked by :meth:`PreparedCorpus.verify`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from qkv.data.parallel import ParallelText
from qkv.data.prepared.format import (
    FORMAT,
    MARKER,
    PREPARE_AGAIN,
    SIDES,
    check_manifest,
    folder_fingerprint,
    split_files,
)
from qkv.data.prepared.integrity import check_hashes, check_split_arrays
from qkv.data.tokenizer import Tokenizer
from qkv.runtime.fileio import read_json


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
        self._pid: int | None = None
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
        """Check the split's arrays against each other and the vocabulary
        (:func:`~qkv.data.prepared.integrity.check_split_arrays`: offsets, length table, every
        id below ``vocab_size``), a window at a time.

        Raises:
            ValueError: one line naming the file, the pair or position, and ending with ``remedy``.
        """
        check_split_arrays(
            self.folder,
            self.name,
            pairs=self.num_pairs,
            tokens=self.num_tokens,
            ids_dtype=self.ids_dtype,
            lengths_dtype=self.lengths_dtype,
            vocab_size=vocab_size,
            remedy=remedy,
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

    def read(self, indices: Iterable[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs ``indices``."""
        indices = list(indices)  # read twice, once a side
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
        """Close the split's open files (only in the process that opened them)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown, os may be gone already
            self.close()


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
        check_manifest(path, self.manifest)
        self.fingerprint: str = self.manifest["fingerprint"]

    def verify(
        self,
        vocab_size: int | None = None,
        *,
        cache: bool = True,
        trust_cache: bool = True,
        remedy: str = PREPARE_AGAIN,
    ) -> None:
        """Check that the folder holds what its manifest says, before a run trains on it: the
        manifest's fingerprint is that of the hashes it lists; every split's files have the
        manifest's sizes and fit together (:meth:`PreparedSplit.check`, with ids below the smaller
        of the manifest's vocabulary and ``vocab_size``, the model's); the tokenizer and every array
        have the manifest's SHA-256. So a run whose recorded fingerprint equals this folder's, verified
        with ``trust_cache=False``, trains on the very bytes it was started on.

        Args:
            vocab_size: the vocabulary the ids must fit (default: the manifest's).
            cache: keep the hashes in the folder's ``verified.json`` (:class:`HashCache`) and use
                them while the files are unchanged.
            trust_cache: use a kept hash for a file whose size and times are those recorded
                (False: hash every file from its contents, what a resume does; the hashes found
                are still kept with ``cache``).
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
        check_hashes(self.folder, expected, cache=cache, trust_cache=trust_cache, remedy=remedy)

    def tokenizer(self) -> Tokenizer:
        """The folder's tokenizer, loaded from the file its manifest names."""
        return Tokenizer.load(self.folder / self.manifest.get("tokenizer", "tokenizer.json"))

    def has(self, split: str) -> bool:
        """Whether the folder holds the split ``split``."""
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
