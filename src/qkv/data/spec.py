"""Where a run's sentences come from: a :class:`DataSpec`, kept in the run folder's config.json as
its ``"data"`` object, so that ``qkv train --resume`` and ``qkv evaluate`` read exactly the data the
run was made from. Its JSON form is one of::

    {"source": "multi30k", "folder": null, "src_lang": "en", "tgt_lang": "de"}
    {"source": "files", "train_src": "a.en", "train_tgt": "a.de", "val_src": "v.en", "val_tgt": "v.de"}
    {"source": "dates", "train_size": 20000, "valid_size": 500, "seed": 0}
    {"source": "prepared", "folder": "/data/wmt14/prepared"}       (made by qkv prepare)
    {"source": "tinyshakespeare", "folder": null}                  (a language model)
    {"source": "text", "train_text": "corpus.txt", "val_text": null, "test_text": null}

A translation source read from text (not a prepared folder) may add ``"both_directions": true``
(:func:`qkv.data.sources.both_directions`). The checks of what a source needs are
:func:`qkv.data.sources.check_spec` and :func:`qkv.data.text.check_text_spec`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# each source's fields, in the order config.json has always listed them
SOURCE_FIELDS: dict[str, tuple[str, ...]] = {
    "multi30k": ("folder", "src_lang", "tgt_lang"),
    "files": ("train_src", "train_tgt", "val_src", "val_tgt"),
    "dates": ("train_size", "valid_size", "seed"),
    "prepared": ("folder",),
    "tinyshakespeare": ("folder",),
    "text": ("train_text", "val_text", "test_text"),
}
# what a field left out means (the values qkv has always read it as)
DEFAULTS: dict[str, dict[str, Any]] = {
    "multi30k": {"src_lang": "en", "tgt_lang": "de"},
    "dates": {"train_size": 20000, "valid_size": 500, "seed": 0},
}
# the files a run reads, which ``--overwrite`` must not delete with the run folder they lie in
INPUT_FIELDS = ("train_src", "train_tgt", "val_src", "val_tgt", "train_text", "val_text", "test_text")
PATH_FIELDS = ("folder", *INPUT_FIELDS)


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where a run's sentences come from (see the module docstring for each source's fields).

    Attributes:
        source: ``multi30k``, ``files``, ``dates`` or ``prepared`` (translation), ``tinyshakespeare``
            or ``text`` (a language model).
        folder: Multi30k's or tiny Shakespeare's data folder (None: looked up), or the prepared folder.
        src_lang: Multi30k's source language (default ``en``).
        tgt_lang: Multi30k's target language (default ``de``).
        train_src: the training source file (``files``); ``train_tgt``, ``val_src``, ``val_tgt`` alike.
        train_size: the date task's training pairs (default 20,000); ``valid_size`` its validation
            pairs (default 500), ``seed`` its random seed (default 0).
        train_text: a language model's training text (``text``); ``val_text``, ``test_text`` alike.
        both_directions: train on the pairs and on the pairs reversed (text translation sources).
    """

    source: str
    folder: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    train_src: str | None = None
    train_tgt: str | None = None
    val_src: str | None = None
    val_tgt: str | None = None
    train_size: int | None = None
    valid_size: int | None = None
    seed: int | None = None
    train_text: str | None = None
    val_text: str | None = None
    test_text: str | None = None
    both_directions: bool = False

    def __post_init__(self) -> None:
        # frozen: the defaults and the str form of a Path are set the one way a frozen dataclass allows
        for name, value in DEFAULTS.get(self.source, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))

    def to_json(self) -> dict[str, Any]:
        """config.json's ``"data"`` object: the source and its fields (see the module docstring),
        and ``"both_directions": true`` where set."""
        names = SOURCE_FIELDS.get(self.source)
        if names is None:  # an unknown source, which the checks refuse: keep whatever was given
            names = tuple(name for name in _SOURCE_DETAILS if getattr(self, name) is not None)
        data: dict[str, Any] = {"source": self.source, **{name: getattr(self, name) for name in names}}
        if self.both_directions:
            data["both_directions"] = True
        return data

    @classmethod
    def from_json(cls, data: object) -> DataSpec:
        """The spec of config.json's ``"data"`` object (of any qkv version: a field left out has
        its default).

        Raises:
            ValueError: not an object with a ``source``, or a field no data spec has.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a data spec is a JSON object, got {data!r}")
        if not isinstance(data.get("source"), str):
            raise ValueError(f"unknown data source {data.get('source')!r}; choose one of {tuple(SOURCE_FIELDS)}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"a data spec has no field {', '.join(map(repr, unknown))}: {dict(data)!r}")
        return cls(**data)

    def input_files(self) -> list[str]:
        """The files and folders the run reads (for ``--overwrite``'s check that none of them lies
        inside the run folder it replaces): a translation source's files or folder, a language
        model's text files."""
        names = ("folder",) if self.source in ("multi30k", "prepared") else INPUT_FIELDS
        return [value for value in (getattr(self, name) for name in names) if value]

    def stray_fields(self) -> list[str]:
        """The fields set that ``source`` does not read (to_json would leave them out)."""
        own = SOURCE_FIELDS.get(self.source, ())
        return [name for name in _SOURCE_DETAILS if name not in own and getattr(self, name) is not None]


# the fields that belong to some sources and not others
_SOURCE_DETAILS = tuple(f.name for f in fields(DataSpec) if f.name not in ("source", "both_directions"))


def as_spec(spec: DataSpec | Mapping[str, Any]) -> DataSpec:
    """``spec`` itself, or the spec of config.json's ``"data"`` object (:meth:`DataSpec.from_json`)."""
    return spec if isinstance(spec, DataSpec) else DataSpec.from_json(spec)
