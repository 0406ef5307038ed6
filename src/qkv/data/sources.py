"""Where a run's sentences come from, described by a small JSON-able dict saved in the run folder.

A *data spec* is one of::

    {"source": "multi30k", "folder": null, "src_lang": "en", "tgt_lang": "de"}
    {"source": "files", "train_src": "a.en", "train_tgt": "a.de", "val_src": "v.en", "val_tgt": "v.de"}
    {"source": "dates", "train_size": 20000, "valid_size": 500, "seed": 0}
    {"source": "prepared", "folder": "/data/wmt14/prepared"}       (made by qkv prepare)

A text source may add ``"both_directions": true``: the training pairs are then the given direction
followed by the reverse one (target -> source), for one model that translates both ways (see
:func:`both_directions`); validation stays in the given direction.

so that ``qkv train --resume`` and ``qkv evaluate`` read exactly the data the run was made from.
"""

from __future__ import annotations

from pathlib import Path

from qkv.data.dates import generate_dates
from qkv.data.parallel import MULTI30K_SPLITS, ParallelText, load_multi30k, read_parallel, resolve_multi30k

SOURCES = ("multi30k", "files", "dates", "prepared")


def recipe_source(source: str) -> str:
    """The data source whose recipe a source trains with (a prepared folder: the files' recipe)."""
    return "files" if source == "prepared" else source


def check_spec(spec: dict) -> dict:
    """Validate a data spec; returns it. Raises ``ValueError`` naming what is missing."""
    source = spec.get("source")
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; choose one of {SOURCES}")
    if source == "files":
        for key in ("train_src", "train_tgt"):
            if not spec.get(key):
                raise ValueError(f"training on files needs {key.replace('_', '-')} (--{key.replace('_', '-')})")
        if bool(spec.get("val_src")) != bool(spec.get("val_tgt")):
            raise ValueError("give both --val-src and --val-tgt, or neither")
    if source == "prepared" and not spec.get("folder"):
        raise ValueError("training on a prepared folder needs its path (--prepared DIR)")
    if spec.get("both_directions") and source == "prepared":
        raise ValueError(
            "--both-directions adds the reversed pairs of text data; a prepared folder holds its "
            "pairs as they were prepared"
        )
    return spec


def both_directions(pairs: ParallelText) -> ParallelText:
    """The pairs, then the same pairs reversed (target -> source): training data for one model that
    translates both ways. No language tag is added: a source sentence's own language says which way
    to translate it. (Bidirectional training of this kind is a known regulariser for small corpora,
    e.g. Ding et al. 2021, "Improving Neural Machine Translation by Bidirectional Training".)"""
    return ParallelText(
        pairs.src + pairs.tgt,
        pairs.tgt + pairs.src,
        f"{pairs.src_path}+{pairs.tgt_path}",
        f"{pairs.tgt_path}+{pairs.src_path}",
    )


def load_train_valid(spec: dict) -> tuple[ParallelText, ParallelText | None]:
    """The training pairs and the validation pairs (None when the spec has none) of a data spec.

    Raises:
        FileNotFoundError / ValueError: a missing or bad file, naming the file and line.
    """
    check_spec(spec)
    if spec["source"] == "prepared":
        raise ValueError("a prepared folder is read a batch at a time (qkv.data.prepared), not loaded whole")
    if spec["source"] == "multi30k":
        folder = resolve_multi30k(spec.get("folder"))
        src, tgt = spec.get("src_lang", "en"), spec.get("tgt_lang", "de")
        return load_multi30k(folder, "train", src, tgt), load_multi30k(folder, "val", src, tgt)
    if spec["source"] == "dates":
        seed = int(spec.get("seed", 0))
        return (
            generate_dates(int(spec.get("train_size", 20000)), seed=seed),
            generate_dates(int(spec.get("valid_size", 500)), seed=seed + 1, split="test"),
        )
    train = read_parallel(spec["train_src"], spec["train_tgt"])
    valid = read_parallel(spec["val_src"], spec["val_tgt"]) if spec.get("val_src") else None
    return train, valid


def load_split(spec: dict, split: str) -> ParallelText:
    """One evaluation split of a run's data: for Multi30k ``train``, ``val``, ``test`` (test 2016)
    or a later test set (``test_2017_flickr``, ``test_2017_mscoco``, ``test_2018_flickr``: downloaded
    into the cache when the data folder lacks it); for the date task ``val`` or ``test`` (fresh
    held-out dates, 2,000); for files ``train`` or ``val``; for a prepared folder ``val`` or
    ``train`` (decoded from its ids).
    """
    check_spec(spec)
    source = spec["source"]
    if source == "prepared":
        from qkv.data.prepared import PreparedCorpus

        names = {"val": "valid", "valid": "valid", "train": "train"}
        corpus = PreparedCorpus(spec["folder"])
        if split not in names or not corpus.has(names[split]):
            raise ValueError(f"this run's prepared folder has no {split!r} split; pass --src and --ref files to score")
        corpus.verify()  # a score is only as good as its references: the arrays are what the manifest says
        return corpus.text(names[split])
    if source == "multi30k":
        if split not in MULTI30K_SPLITS:
            raise ValueError(f"unknown Multi30k split {split!r}; choose one of {sorted(MULTI30K_SPLITS)}")
        folder = resolve_multi30k(spec.get("folder"))
        return load_multi30k(folder, split, spec.get("src_lang", "en"), spec.get("tgt_lang", "de"), download=True)
    if source == "dates":
        seed = int(spec.get("seed", 0))
        if split in ("val", "valid"):
            return generate_dates(int(spec.get("valid_size", 500)), seed=seed + 1, split="test")
        if split == "test":
            return generate_dates(2000, seed=seed + 2, split="test")
        raise ValueError(f"the date task has splits 'val' and 'test', not {split!r}")
    if split == "train":
        return read_parallel(spec["train_src"], spec["train_tgt"])
    if split in ("val", "valid") and spec.get("val_src"):
        return read_parallel(spec["val_src"], spec["val_tgt"])
    raise ValueError(f"this run has no {split!r} split; pass --src and --ref files to score")


def describe(spec: dict) -> str:
    """A short human description, e.g. ``Multi30k en->de`` or ``files a.en -> a.de``."""
    if spec.get("both_directions"):
        return describe({k: v for k, v in spec.items() if k != "both_directions"}) + " and back (both directions)"
    if spec["source"] == "multi30k":
        return f"Multi30k {spec.get('src_lang', 'en')}->{spec.get('tgt_lang', 'de')}"
    if spec["source"] == "dates":
        return "the built-in date task"
    if spec["source"] == "prepared":
        return f"the prepared folder {spec['folder']}"
    return f"{Path(spec['train_src']).name} -> {Path(spec['train_tgt']).name}"
