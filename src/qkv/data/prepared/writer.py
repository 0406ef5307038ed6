"""Writing a prepared folder (:mod:`qkv.data.prepared`): a split's arrays appended a chunk at a time
(:class:`SplitWriter`, what ``qkv prepare`` streams into), or whole from token lists in memory
(:func:`write_token_lists`, a run's own copy of its pairs); the manifest last; the folder built under
a temporary name and renamed when whole (:func:`building_folder`)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qkv.data.prepared.format import (
    FORMAT,
    MARKER,
    SIDES,
    folder_fingerprint,
    is_prepared_folder,
    length_dtype,
    split_files,
    token_dtype,
)
from qkv.data.prepared.integrity import CACHE_FILE
from qkv.data.tokenizer import Tokenizer
from qkv.runtime.fileio import atomic_folder, read_json, write_json
from qkv.runtime.overwrite import check_output_folder as check_replaceable


class SplitWriter:
    """Appends tokenized pairs to one split's files (in a folder being built), hashing as it writes.

    Args:
        folder: the folder being built.
        split: ``train`` or ``valid``.
        ids_dtype: the id arrays' type (:func:`token_dtype`).
        lengths_dtype: the length table's type (:func:`length_dtype` of the longest sentence allowed).
    """

    def __init__(self, folder: Path, split: str, *, ids_dtype: npt.DTypeLike, lengths_dtype: npt.DTypeLike) -> None:
        self.folder, self.split = Path(folder), split
        self.ids_dtype, self.lengths_dtype = np.dtype(ids_dtype), np.dtype(lengths_dtype)
        names = split_files(split)
        # open while the split is written, closed by close(): no single with-block spans that
        self.files = {name: open(self.folder / name, "wb") for name in names}  # noqa: SIM115
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
        ValueError: ``out`` exists (without ``overwrite``, or not a prepared folder holding only its files).
        PermissionError: ``out`` or where it would be made is not writable.
    """
    target = check_output_folder(Path(out), overwrite=overwrite)
    with atomic_folder(target, tag="partial") as tmp:
        yield tmp
        if not is_prepared_folder(tmp):
            raise RuntimeError(f"{tmp}: no manifest written; the folder is not complete")


def prepared_files(folder: Path) -> set[str] | str:
    """The files the prepared folder at ``folder`` holds by its manifest: the manifest, the tokenizer,
    every split's arrays and the hash cache qkv keeps beside them; or why ``folder`` is not a prepared
    folder (a clause for a message).

    Args:
        folder: an existing folder.

    Returns:
        relative file names, or the reason.
    """
    path = folder / "manifest.json"
    if not path.is_file():
        return "it has no manifest.json: not a prepared folder"
    if not is_prepared_folder(folder):
        return f"its manifest.json is not a prepared folder's (no '{MARKER}': {FORMAT})"
    try:
        manifest = read_json(path)
        names = {"manifest.json", str(manifest.get("tokenizer") or "tokenizer.json"), CACHE_FILE}
        for info in manifest["splits"].values():
            names.update(str(name) for name in info["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "its manifest.json does not list its files"
    return names


def _inside_a_run_or_model(folder: Path) -> str | None:
    """Why ``qkv prepare`` must not build in or inside ``folder``: it holds ``config.json`` and
    ``tokenizer.json``, as a qkv run does (whose ``data/`` is a prepared folder of its own, which
    only the run may write) and a model folder does; None otherwise. This layer cannot import the
    run folder's own test (:func:`qkv.runs.folder.is_run_folder`), and this one refuses more."""
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return "a run or model folder (config.json, tokenizer.json)"
    return None


def check_output_folder(out: Path, *, overwrite: bool) -> Path:
    """Check, before any work, that a prepared folder may be built at ``out``: it does not exist, or
    (with ``overwrite``) is empty or an earlier prepared folder holding only the files its manifest
    lists; never inside a run or model folder. Returns the path to build at.

    Raises:
        ValueError: ``out`` may not be written (one line saying why and what to do).
        PermissionError: ``out`` or where it would be made is not writable.
    """
    return check_replaceable(
        out,
        overwrite=overwrite,
        what="prepared folder",
        own_files=prepared_files,
        refuse=_inside_a_run_or_model,
        empty_needs_overwrite=True,
    )


def write_manifest(folder: Path, tokenizer: Tokenizer, splits: dict[str, dict], **info: Any) -> dict:
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


def write_token_lists(folder: Path, tokenizer: Tokenizer, splits: dict[str, tuple], **info: Any) -> dict:
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
