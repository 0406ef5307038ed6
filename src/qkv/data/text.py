"""Plain text for language models: reading it, its tokenizers, and its token arrays on disk.

A language model's data spec (:class:`~qkv.data.spec.DataSpec`) is one of::

    {"source": "tinyshakespeare", "folder": null}
    {"source": "text", "train_text": "corpus.txt", "val_text": null, "test_text": null}

Three splits (:func:`read_text_splits`). Without a validation file (tiny Shakespeare, or
``--train-text`` alone) the text is cut by position, on characters (Unicode code points, as Python
indexes a ``str``): with ``n`` characters, ``text[:n * 90 // 100]`` trains,
``text[n * 90 // 100 : n * 95 // 100]`` validates and ``text[n * 95 // 100:]`` is the test split
(:func:`split_positions`). With ``val_text`` the whole training file trains, that file validates,
and ``test_text`` (optional, and only beside ``val_text``) is the test split; without it a run has
none. Each split is tokenised on its own, so no token and no window crosses a cut.

The text is tokenised once, when a run starts, into ``train.bin`` / ``val.bin`` / ``test.bin`` in
the run folder: flat arrays of token ids (uint16, or uint32 for vocabularies over 65,536),
memory-mapped, the layout of nanoGPT's ``.bin`` files. Training reads the first two (validation
is what early stopping and the best checkpoint are chosen on); ``test.bin`` is read only by
``qkv evaluate``. A run folder made before the test split existed holds ``train.bin`` and
``val.bin`` alone (its validation split was the last 10% of the text).

Tokenizers: :class:`CharTokenizer` (one id per character of the training text) and the byte-level
BPE :class:`~qkv.data.tokenizer.Tokenizer` (``--tokenizer bpe --vocab-size N``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from qkv.data.spec import DataSpec, as_spec
from qkv.data.tokenizer import Tokenizer
from qkv.runtime.fileio import atomic_path, default_cache_dir, write_json
from qkv.runtime.textinput import open_input

logger = logging.getLogger(__name__)

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TEXT_SOURCES = ("tinyshakespeare", "text")
TOKENIZER_KINDS = ("char", "bpe")
SPLIT_PERCENT = (90, 5, 5)  # train, validation, test: the cut by position of a text without --val-text
SPLIT_NAMES = ("train", "val", "test")


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path`` (a FIFO or ``/dev/fd/N`` too). Raises ``FileNotFoundError`` /
    ``IsADirectoryError`` / ``PermissionError`` (a missing, folder or unreadable path, see
    :func:`qkv.runtime.textinput.open_input`), or ``ValueError`` for a file that is empty or not
    UTF-8 (naming the line of the first bad byte)."""
    path = Path(path)
    with open_input(path, "text file") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r})"
        ) from None
    if not text.strip():
        raise ValueError(f"{path}: the text is empty")
    return text


def resolve_tinyshakespeare(root: str | Path | None = None, *, download: bool = True) -> Path:
    """The path of tiny Shakespeare's ``input.txt``: in ``root``, ``$QKV_DATA/tinyshakespeare`` or
    ``<cache>/tinyshakespeare``, else downloaded into the cache (written atomically)."""
    candidates = [Path(root)] if root is not None else []
    if os.environ.get("QKV_DATA"):
        candidates.append(Path(os.environ["QKV_DATA"]) / "tinyshakespeare")
    cache = default_cache_dir() / "tinyshakespeare"
    candidates.append(cache)
    for folder in candidates:
        if (folder / "input.txt").is_file():
            return folder / "input.txt"
    if not download:
        raise FileNotFoundError(
            f"tiny Shakespeare (input.txt) not found in {', '.join(map(str, candidates))}; set "
            "QKV_DATA to a folder holding tinyshakespeare/input.txt"
        )
    target = cache / "input.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s", TINYSHAKESPEARE_URL)
    try:
        with (
            atomic_path(target) as tmp,
            open(tmp, "wb") as out,
            urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=60) as response,
        ):
            shutil.copyfileobj(response, out)
    except OSError as err:
        raise FileNotFoundError(
            f"could not download {TINYSHAKESPEARE_URL} ({err}); put input.txt in "
            "$QKV_DATA/tinyshakespeare or pass --data-dir"
        ) from err
    return target


def check_text_spec(spec: DataSpec) -> DataSpec:
    """``spec`` when it is a language-model data spec qkv can read; ``ValueError`` saying what is wrong."""
    if spec.source not in TEXT_SOURCES:
        raise ValueError(f"unknown text source {spec.source!r}; choose one of {TEXT_SOURCES}")
    if spec.source == "text":
        if not spec.train_text:
            raise ValueError("training a language model on a file needs --train-text FILE")
        if spec.test_text and not spec.val_text:
            raise ValueError(
                "--test-text needs --val-text (without --val-text, the last 5% of --train-text is the "
                "test split and the 5% before it validates)"
            )
        named = {"--train-text": spec.train_text, "--val-text": spec.val_text, "--test-text": spec.test_text}
        seen: dict[Path, str] = {}
        for flag, path in named.items():
            if not path:
                continue
            key = Path(path).resolve()
            if key in seen:
                raise ValueError(f"{flag} {path}: the same file as {seen[key]}; each split needs its own text")
            seen[key] = flag
    elif spec.test_text or spec.val_text:
        raise ValueError("--val-text and --test-text go with --train-text; tiny Shakespeare is cut by position")
    stray = spec.stray_fields()
    if stray:
        raise ValueError(f"the data source {spec.source!r} does not read {', '.join(stray)}")
    return spec


def split_positions(length: int) -> tuple[int, int]:
    """Where a text of ``length`` characters is cut: ``(a, b)`` with ``text[:a]`` training,
    ``text[a:b]`` validation and ``text[b:]`` the test split (90%, 5%, 5%, by
    :data:`SPLIT_PERCENT`, rounded down in integers: exact and the same on every machine)."""
    train, val, _ = SPLIT_PERCENT
    return length * train // 100, length * (train + val) // 100


class TextSplits(NamedTuple):
    """A language model's texts: ``test`` is None where there is no test split (``--val-text``
    without ``--test-text``); ``chars`` gives each split's character range ``[start, end)`` in
    the text it was cut from (its own file for a split given as a file); ``where`` says where
    they came from."""

    train: str
    val: str
    test: str | None
    where: str
    chars: dict


def read_text_splits(spec: DataSpec | Mapping[str, Any]) -> TextSplits:
    """The training, validation and test texts of a text data spec, or of config.json's ``"data"``
    object (see the module docstring)."""
    spec = check_text_spec(as_spec(spec))
    train_path: str | Path
    if spec.source == "tinyshakespeare":
        train_path, val_path, test_path = resolve_tinyshakespeare(spec.folder), None, None
    else:
        assert spec.train_text  # check_text_spec: a text source names its training text
        train_path, val_path, test_path = spec.train_text, spec.val_text, spec.test_text
    text = read_text(train_path)
    if val_path:
        val = read_text(val_path)
        test = read_text(test_path) if test_path else None
        where = f"{train_path} (validation {val_path}, " + (f"test {test_path})" if test_path else "no test split)")
        chars = {"train": [0, len(text)], "val": [0, len(val)], "test": [0, len(test)] if test is not None else None}
        return TextSplits(text, val, test, where, chars)
    a, b = split_positions(len(text))
    where = f"{train_path} (by position: characters [0, {a}) train, [{a}, {b}) validation, [{b}, {len(text)}) test)"
    return TextSplits(text[:a], text[a:b], text[b:], where, {"train": [0, a], "val": [a, b], "test": [b, len(text)]})


def load_text_splits(spec: DataSpec | Mapping[str, Any]) -> tuple[str, str, str]:
    """``(training text, validation text, where they came from)`` of a text data spec: the first
    two splits of :func:`read_text_splits` (the test split is left out)."""
    splits = read_text_splits(spec)
    return splits.train, splits.val, splits.where


class CharTokenizer:
    """One id per distinct character of the training text (sorted), nothing else: no special
    tokens, and a character it has not seen cannot be encoded."""

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if not self.chars:
            raise ValueError("a character vocabulary needs at least one character")
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        """A tokenizer whose vocabulary is the characters of ``text``."""
        return cls(text)

    @property
    def vocab_size(self) -> int:
        """The number of characters in the vocabulary."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; ``ValueError`` listing the characters the vocabulary lacks."""
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            missing = sorted({c for c in text if c not in self._ids})
            shown = ", ".join(repr(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise ValueError(
                f"{len(missing)} character{'' if len(missing) == 1 else 's'} not in the model's vocabulary "
                f"of {self.vocab_size}: {shown}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""
        return "".join(self.chars[int(i)] for i in ids)

    def tokens(self, text: str) -> list[str]:
        """The tokens of ``text``: its characters."""
        return list(text)

    def save(self, path: str | Path) -> None:
        """Write the vocabulary to ``path`` as JSON (atomically)."""
        write_json(path, {"qkv_tokenizer": "char", "chars": "".join(self.chars)}, indent=None)


def train_text_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> CharTokenizer | Tokenizer:
    """A ``char`` or byte-level ``bpe`` tokenizer learned on ``text``."""
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        if vocab_size is None:
            raise ValueError("--tokenizer bpe needs --vocab-size")
        return Tokenizer.train(text.splitlines(keepends=True), vocab_size=vocab_size)
    raise ValueError(f"unknown tokenizer {kind!r}; choose one of {TOKENIZER_KINDS}")


def load_text_tokenizer(path: str | Path) -> CharTokenizer | Tokenizer:
    """Read the ``tokenizer.json`` of a language-model run (character or BPE)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if isinstance(data, dict) and data.get("qkv_tokenizer") == "char":
        chars = data.get("chars")
        if not isinstance(chars, str) or not chars or len(set(chars)) != len(chars):
            raise ValueError(f"{path}: not a valid character tokenizer ('chars' must list distinct characters)")
        return CharTokenizer(chars)
    return Tokenizer.load(path)


def token_dtype(vocab_size: int) -> type:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def write_tokens(path: str | Path, ids: list[int] | np.ndarray, vocab_size: int) -> Path:
    """Write token ids as a flat binary array (atomically)."""
    array: np.ndarray = np.asarray(ids, dtype=token_dtype(vocab_size))
    with atomic_path(path) as tmp:
        array.tofile(tmp)
    return Path(path)


def read_tokens(path: str | Path, vocab_size: int) -> np.ndarray:
    """Memory-map a token array written by :func:`write_tokens` (read-only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: token array not found")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=token_dtype(vocab_size))
    return np.memmap(path, dtype=token_dtype(vocab_size), mode="r")


@dataclass(frozen=True, kw_only=True)
class TextTrainingData:
    """A language model's data, read and tokenised (:func:`open_text_training_data`).

    Attributes:
        tokenizer: learned on the training text (a character one also on the other splits' characters).
        ids: each split's token ids (``train``, ``val``, and ``test`` where there is one).
        splits: config.json's record of each split: its character range in its text, its token
            count and characters per token (None for a test split the run lacks).
        where: where the text came from and how it was cut, for the log.
    """

    tokenizer: CharTokenizer | Tokenizer
    ids: dict[str, np.ndarray]
    splits: dict[str, dict[str, Any] | None]
    where: str


def open_text_training_data(spec: DataSpec, *, tokenizer_kind: str, vocab_size: int | None = None) -> TextTrainingData:
    """Read a language model's text, cut it into its splits (:func:`read_text_splits`), learn the
    tokenizer and tokenise each split on its own.

    Args:
        spec: a language-model data spec (:func:`check_text_spec`).
        tokenizer_kind: ``char`` or ``bpe`` (:data:`TOKENIZER_KINDS`).
        vocab_size: the BPE vocabulary (``bpe`` only).

    Returns:
        the tokenizer, each split's ids and config.json's record of the splits.

    Raises:
        FileNotFoundError / ValueError: a missing, empty or non-UTF-8 text.
    """
    texts = read_text_splits(spec)
    named = {name: text for name, text in zip(SPLIT_NAMES, texts[:3]) if text is not None}
    # a character vocabulary covers the validation and test texts' characters too (the set of them, nothing
    # more): a character seen only there is still predicted, and can be encoded
    learn_on = "".join(named.values()) if tokenizer_kind == "char" else texts.train
    tokenizer = train_text_tokenizer(tokenizer_kind, learn_on, vocab_size)
    ids = {name: np.asarray(tokenizer.encode(text), dtype=np.int64) for name, text in named.items()}
    splits: dict[str, dict[str, Any] | None] = dict.fromkeys(SPLIT_NAMES)
    for name, text in named.items():
        tokens = len(ids[name])
        splits[name] = {
            "chars": texts.chars[name],
            "tokens": tokens,
            "chars_per_token": round(len(text) / max(1, tokens), 6),
        }
    return TextTrainingData(tokenizer=tokenizer, ids=ids, splits=splits, where=texts.where)
