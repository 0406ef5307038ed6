"""The on-disk format of a prepared folder (:mod:`qkv.data.prepared`): the names and types of its
arrays, and its manifest's marker, required fields and fingerprint. The writer
(:mod:`qkv.data.prepared.writer`), the reader and the integrity checks
(:mod:`qkv.data.prepared.integrity`) agree through this module alone."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

MARKER, FORMAT = "qkv_prepared", 1
SIDES = ("src", "tgt")
ARRAY_DTYPES = ("uint16", "uint32")  # the types token_dtype and length_dtype choose
PREPARE_AGAIN = "the prepared folder is damaged: prepare it again (qkv prepare --overwrite)"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def length_dtype(longest: int) -> np.dtype:
    """The dtype of a length table whose longest sentence has ``longest`` tokens."""
    return np.dtype(np.uint16 if longest < 2**16 else np.uint32)


def is_prepared_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete prepared corpus (its manifest, marked)."""
    try:
        return json.loads((Path(folder) / "manifest.json").read_text(encoding="utf-8")).get(MARKER) == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def split_files(split: str) -> list[str]:
    """The array files of a split, in the order SplitWriter writes them."""
    return [f"{split}.{side}.{kind}" for side in SIDES for kind in ("bin", "idx")] + [f"{split}.len", f"{split}.lines"]


def folder_fingerprint(tokenizer_sha: str, splits: dict[str, dict]) -> str:
    """The manifest's fingerprint: a SHA-256 over the tokenizer's hash and each split's counts,
    types and file hashes, so that one string says whether two folders hold the same data."""
    text = json.dumps({"tokenizer": tokenizer_sha, "splits": splits}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """The fields a prepared folder is read by, with the types and values qkv prepare writes:
    ``ValueError`` naming the manifest and the field otherwise."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{path}: {field} {why}; {PREPARE_AGAIN}")

    def count(value: object) -> bool:
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
