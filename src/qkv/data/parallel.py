"""Line-aligned parallel text: reading plain or gzipped files with clear errors, and Multi30k.

A parallel corpus is two files with one sentence a line; line ``i`` of the source file translates
line ``i`` of the target file. Errors name the file and the (1-based) line.
"""

from __future__ import annotations

import logging
import os
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from qkv.runtime.fileio import atomic_path, default_cache_dir
from qkv.runtime.textinput import empty_input, iter_lines, open_input

logger = logging.getLogger(__name__)

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}"
MULTI30K_SPLITS = {
    "train": "train",
    "val": "val",
    "valid": "val",
    "test": "test_2016_flickr",
    "test2016": "test_2016_flickr",
    "test_2016_flickr": "test_2016_flickr",
}
# The later shared tasks' test sets (WMT 2017 and 2018; MSCOCO: captions of other images). Nothing in
# qkv chooses a setting on them; they are fetched into the cache the first time a split is asked for.
MULTI30K_LATER_TESTS = ("test_2017_flickr", "test_2017_mscoco", "test_2018_flickr")
MULTI30K_SPLITS.update({stem: stem for stem in MULTI30K_LATER_TESTS})
MULTI30K_SPLITS.update(test2017="test_2017_flickr", mscoco2017="test_2017_mscoco", test2018="test_2018_flickr")
MULTI30K_LANGS = ("en", "de", "fr")


@dataclass
class ParallelText:
    """Aligned source and target sentences (same length lists)."""

    src: list[str]
    tgt: list[str]
    src_path: str = ""
    tgt_path: str = ""

    def __len__(self) -> int:
        return len(self.src)


def read_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file (``.gz`` is decompressed) into lines without their newline, a line at
    a time (:mod:`qkv.runtime.textinput`: a FIFO or ``/dev/fd/N`` is read too, a line is at most
    :data:`~qkv.runtime.textinput.MAX_LINE_BYTES`).

    Raises:
        FileNotFoundError / IsADirectoryError / PermissionError: the file is missing, a directory,
            or not readable (one line saying which).
        ValueError: the file is empty, cannot be read (a truncated ``.gz``), is not valid UTF-8,
            has a line over the length bound, or has an empty line (names the line; an empty
            sentence cannot be translated or scored).
    """
    text = []
    with open_input(path, decompress=True) as handle:
        for number, line in iter_lines(handle, str(path)):
            if not line.strip():
                raise ValueError(f"{path}, line {number}: empty line (every line must hold a sentence)")
            text.append(line)
    if not text:
        raise ValueError(f"{path}: {empty_input(path)}")
    return text


def decode_lines(data: bytes, name: str = "<stdin>") -> list[str]:
    """Split UTF-8 ``data`` already in memory into lines; ``ValueError`` naming the line of the first
    byte that is not UTF-8. (A stream, such as standard input, is read with a bound on each line's
    length by :func:`qkv.runtime.textinput.read_input_lines` instead.)"""
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{name}, line {line}: not valid UTF-8 ({err.reason} at byte {err.start})") from None


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelText:
    """Read two line-aligned files. Raises ``ValueError`` naming both files when the line counts
    differ, and naming the file and line for empty lines or bad UTF-8."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        shorter, n = (src_path, len(src)) if len(src) < len(tgt) else (tgt_path, len(tgt))
        raise ValueError(
            f"misaligned parallel files: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)} lines "
            f"({shorter} ends at line {n}; line {n + 1} has no partner)"
        )
    return ParallelText(src, tgt, str(src_path), str(tgt_path))


def _has_multi30k(folder: Path) -> bool:
    return any((folder / f"train.en{ext}").is_file() for ext in (".gz", ""))


def resolve_multi30k(root: str | Path | None = None, *, download: bool = True) -> Path:
    """Find the folder holding the Multi30k task-1 files (``train.en.gz``, ``val.de.gz``, ...).

    Looks in order at ``root``, ``$QKV_DATA/multi30k``, ``<cache>/multi30k``; if none holds the
    files and ``download`` is True, downloads them from the upstream repository into the cache.
    """
    candidates = []
    if root is not None:
        candidates.append(Path(root))
    if os.environ.get("QKV_DATA"):
        candidates.append(Path(os.environ["QKV_DATA"]) / "multi30k")
    cache = default_cache_dir() / "multi30k"
    candidates.append(cache)
    for folder in candidates:
        if _has_multi30k(folder):
            return folder
    if not download:
        raise FileNotFoundError(
            f"Multi30k not found in {', '.join(map(str, candidates))}; set QKV_DATA to a folder holding multi30k/"
        )
    download_multi30k(cache)
    return cache


def download_multi30k(
    folder: Path, langs: tuple[str, ...] = ("en", "de"), timeout: float = 60.0, stems: tuple[str, ...] | None = None
) -> None:
    """Download the task-1 raw files for ``langs`` into ``folder`` (each file written atomically):
    ``stems`` (default: train, val and test 2016; the later test sets when asked for)."""
    folder.mkdir(parents=True, exist_ok=True)
    if stems is None:
        stems = tuple(sorted(set(MULTI30K_SPLITS.values()) - set(MULTI30K_LATER_TESTS)))
    for stem in stems:
        for lang in langs:
            name = f"{stem}.{lang}.gz"
            target = folder / name
            if target.is_file():
                continue
            url = MULTI30K_URL.format(name=name)
            logger.info("downloading %s", url)
            try:
                with (
                    atomic_path(target) as tmp,
                    open(tmp, "wb") as out,
                    urllib.request.urlopen(url, timeout=timeout) as response,
                ):
                    shutil.copyfileobj(response, out)
            except OSError as err:
                raise FileNotFoundError(
                    f"could not download Multi30k file {url} ({err}); put the files in $QKV_DATA/multi30k"
                ) from err


def multi30k_paths(folder: str | Path, split: str, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    """Paths of one Multi30k split (plain or .gz) for a language pair."""
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"unknown Multi30k split {split!r}; choose one of {sorted(MULTI30K_SPLITS)}")
    for lang in (src_lang, tgt_lang):
        if lang not in MULTI30K_LANGS:
            raise ValueError(f"unknown Multi30k language {lang!r}; choose one of {MULTI30K_LANGS}")
    stem = MULTI30K_SPLITS[split]
    paths = []
    for lang in (src_lang, tgt_lang):
        gz, plain = Path(folder) / f"{stem}.{lang}.gz", Path(folder) / f"{stem}.{lang}"
        paths.append(gz if gz.is_file() or not plain.is_file() else plain)
    return paths[0], paths[1]


def load_multi30k(
    folder: str | Path, split: str, src_lang: str = "en", tgt_lang: str = "de", *, download: bool = False
) -> ParallelText:
    """Read one Multi30k split for ``src_lang -> tgt_lang`` from ``folder``. A later test set
    (:data:`MULTI30K_LATER_TESTS`) that ``folder`` lacks is read from the cache instead, downloaded
    there first when ``download`` is True (``folder`` itself is never written)."""
    src_path, tgt_path = multi30k_paths(folder, split, src_lang, tgt_lang)
    if MULTI30K_SPLITS.get(split) in MULTI30K_LATER_TESTS and not (src_path.is_file() and tgt_path.is_file()):
        cache = default_cache_dir() / "multi30k"
        src_path, tgt_path = multi30k_paths(cache, split, src_lang, tgt_lang)
        if download and not (src_path.is_file() and tgt_path.is_file()):
            download_multi30k(cache, (src_lang, tgt_lang), stems=(MULTI30K_SPLITS[split],))
            src_path, tgt_path = multi30k_paths(cache, split, src_lang, tgt_lang)
    return read_parallel(src_path, tgt_path)
