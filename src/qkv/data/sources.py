"""Where a translation run's sentence pairs come from (a :class:`~qkv.data.spec.DataSpec`: Multi30k,
text files, the date task or a prepared folder), and reading them for a run.

A text source may add ``both_directions``: the training pairs are then the given direction followed
by the reverse one (target -> source), for one model that translates both ways (see
:func:`both_directions`); validation stays in the given direction.

:func:`open_training_data` is all a new run does with its data: read the pairs, learn the tokenizer
(or open a prepared folder's, verified) and fingerprint them, so that ``qkv train --resume`` knows
the data is unchanged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qkv.data.dates import generate_dates
from qkv.data.parallel import MULTI30K_SPLITS, ParallelText, load_multi30k, read_parallel, resolve_multi30k
from qkv.data.prepared import PreparedCorpus, PreparedSplit
from qkv.data.spec import DataSpec, as_spec
from qkv.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SOURCES = ("multi30k", "files", "dates", "prepared")


def recipe_source(source: str) -> str:
    """The data source whose recipe a source trains with (a prepared folder: the files' recipe)."""
    return "files" if source == "prepared" else source


def check_spec(spec: DataSpec) -> DataSpec:
    """Validate a translation data spec; returns it. Raises ``ValueError`` naming what is missing."""
    source = spec.source
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; choose one of {SOURCES}")
    stray = spec.stray_fields()
    if stray:
        raise ValueError(f"the data source {source!r} does not read {', '.join(stray)}")
    if source == "files":
        for key in ("train_src", "train_tgt"):
            if not getattr(spec, key):
                raise ValueError(f"training on files needs {key.replace('_', '-')} (--{key.replace('_', '-')})")
        if bool(spec.val_src) != bool(spec.val_tgt):
            raise ValueError("give both --val-src and --val-tgt, or neither")
    if source == "prepared" and not spec.folder:
        raise ValueError("training on a prepared folder needs its path (--prepared DIR)")
    if spec.both_directions and source == "prepared":
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


def load_train_valid(spec: DataSpec | Mapping[str, Any]) -> tuple[ParallelText, ParallelText | None]:
    """The training pairs and the validation pairs (None when the spec has none) of a data spec
    (or of config.json's ``"data"`` object).

    Raises:
        FileNotFoundError / ValueError: a missing or bad file, naming the file and line.
    """
    spec = check_spec(as_spec(spec))
    if spec.source == "prepared":
        raise ValueError("a prepared folder is read a batch at a time (qkv.data.prepared), not loaded whole")
    if spec.source == "multi30k":
        folder = resolve_multi30k(spec.folder)
        src, tgt = spec.src_lang or "en", spec.tgt_lang or "de"
        return load_multi30k(folder, "train", src, tgt), load_multi30k(folder, "val", src, tgt)
    if spec.source == "dates":
        seed = int(spec.seed or 0)
        return (
            generate_dates(int(spec.train_size or 0), seed=seed),
            generate_dates(int(spec.valid_size or 0), seed=seed + 1, split="test"),
        )
    assert spec.train_src and spec.train_tgt  # check_spec: files need both
    train = read_parallel(spec.train_src, spec.train_tgt)
    valid = read_parallel(spec.val_src, spec.val_tgt) if spec.val_src and spec.val_tgt else None
    return train, valid


def load_split(spec: DataSpec | Mapping[str, Any], split: str) -> ParallelText:
    """One evaluation split of a run's data (its spec, or config.json's ``"data"`` object): for
    Multi30k ``train``, ``val``, ``test`` (test 2016) or a later test set (``test_2017_flickr``,
    ``test_2017_mscoco``, ``test_2018_flickr``: downloaded into the cache when the data folder lacks
    it); for the date task ``val`` or ``test`` (fresh held-out dates, 2,000); for files ``train`` or
    ``val``; for a prepared folder ``val`` or ``train`` (decoded from its ids).
    """
    spec = check_spec(as_spec(spec))
    source = spec.source
    if source == "prepared":
        assert spec.folder  # check_spec: a prepared source names its folder
        names = {"val": "valid", "valid": "valid", "train": "train"}
        corpus = PreparedCorpus(spec.folder)
        if split not in names or not corpus.has(names[split]):
            raise ValueError(f"this run's prepared folder has no {split!r} split; pass --src and --ref files to score")
        corpus.verify()  # a score is only as good as its references: the arrays are what the manifest says
        return corpus.text(names[split])
    if source == "multi30k":
        if split not in MULTI30K_SPLITS:
            raise ValueError(f"unknown Multi30k split {split!r}; choose one of {sorted(MULTI30K_SPLITS)}")
        folder = resolve_multi30k(spec.folder)
        return load_multi30k(folder, split, spec.src_lang or "en", spec.tgt_lang or "de", download=True)
    if source == "dates":
        seed = int(spec.seed or 0)
        if split in ("val", "valid"):
            return generate_dates(int(spec.valid_size or 0), seed=seed + 1, split="test")
        if split == "test":
            return generate_dates(2000, seed=seed + 2, split="test")
        raise ValueError(f"the date task has splits 'val' and 'test', not {split!r}")
    assert spec.train_src and spec.train_tgt  # check_spec: files need both
    if split == "train":
        return read_parallel(spec.train_src, spec.train_tgt)
    if split in ("val", "valid") and spec.val_src and spec.val_tgt:
        return read_parallel(spec.val_src, spec.val_tgt)
    raise ValueError(f"this run has no {split!r} split; pass --src and --ref files to score")


def describe(spec: DataSpec) -> str:
    """A short human description, e.g. ``Multi30k en->de`` or ``files a.en -> a.de``."""
    if spec.both_directions:
        return describe(replace(spec, both_directions=False)) + " and back (both directions)"
    if spec.source == "multi30k":
        return f"Multi30k {spec.src_lang}->{spec.tgt_lang}"
    if spec.source == "dates":
        return "the built-in date task"
    if spec.source == "prepared":
        return f"the prepared folder {spec.folder}"
    return f"{Path(spec.train_src or '').name} -> {Path(spec.train_tgt or '').name}"


def data_fingerprint(data: ParallelText) -> dict[str, Any]:
    """Number of pairs and a SHA-256 of their text: how a resumed run knows its data is unchanged."""
    digest = hashlib.sha256()
    for src, tgt in zip(data.src, data.tgt):
        digest.update(src.encode("utf-8", "surrogatepass") + b"\t" + tgt.encode("utf-8", "surrogatepass") + b"\n")
    return {"pairs": len(data), "sha256": digest.hexdigest()}


@dataclass(frozen=True, kw_only=True)
class TrainingData:
    """A translation run's data, read and ready to train on (:func:`open_training_data`).

    Attributes:
        tokenizer: the shared BPE tokenizer (learned from the training text, or the prepared folder's).
        train: the training pairs: text (both ways round after the given direction when the spec
            says ``both_directions``), or a prepared folder's split, read a batch at a time.
        valid: the validation pairs, or None.
        fingerprint: ``{"pairs": n, "sha256": hex}``: of the source text (before any reversed
            pairs) or of the prepared folder, which a resumed run compares.
        corpus: the prepared folder the data was read from, verified; None for text, which the run
            copies into its own folder.
    """

    tokenizer: Tokenizer
    train: ParallelText | PreparedSplit
    valid: ParallelText | None
    fingerprint: dict[str, Any]
    corpus: PreparedCorpus | None


def open_training_data(spec: DataSpec, *, vocab_size: int | None, split_digits: bool) -> TrainingData:
    """Read a translation run's data: its text, with a tokenizer learned on the training pairs, or
    a prepared folder (verified against its manifest, so that its fingerprint means its bytes).

    Args:
        spec: a translation data spec (:func:`check_spec`).
        vocab_size: the BPE vocabulary to learn from text; for a prepared folder, the one asked
            for, if any (the folder's own tokenizer is used; a different size is reported).
        split_digits: whether the learned tokenizer makes every digit a token of its own.

    Returns:
        the tokenizer, the training and validation pairs and their fingerprint.

    Raises:
        FileNotFoundError / ValueError: a missing or bad file, or a damaged prepared folder.
    """
    check_spec(spec)
    if spec.source == "prepared":
        data = _open_prepared(spec, vocab_size)
    else:
        if vocab_size is None:
            raise ValueError("learning a tokenizer from text needs its vocab_size")
        train, valid = load_train_valid(spec)
        tokenizer = Tokenizer.train(train.src + train.tgt, vocab_size=vocab_size, split_digits=split_digits)
        fingerprint = data_fingerprint(train)  # of the source text, which a resume checks is unchanged
        if spec.both_directions:  # after the tokenizer, which saw every sentence once either way
            train = both_directions(train)
        data = TrainingData(tokenizer=tokenizer, train=train, valid=valid, fingerprint=fingerprint, corpus=None)
    valid_pairs = len(data.valid) if data.valid is not None else "no"
    logger.info("data: %s, %d training pairs, %s validation pairs", describe(spec), len(data.train), valid_pairs)
    return data


def _open_prepared(spec: DataSpec, vocab_size: int | None) -> TrainingData:
    assert spec.folder  # check_spec: a prepared source names its folder
    corpus = PreparedCorpus(spec.folder)
    tokenizer = corpus.tokenizer()
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        logger.warning(
            "a %d-token vocabulary asked for, but the prepared folder's tokenizer has %d ids: training "
            "with those (prepare with --vocab-size %d to match)",
            vocab_size,
            tokenizer.vocab_size,
            vocab_size,
        )
    corpus.verify(tokenizer.vocab_size)  # the arrays are what the manifest, and so the fingerprint, says
    train = corpus.split("train")
    valid = corpus.text("valid", tokenizer) if corpus.has("valid") else None
    fingerprint = {"pairs": len(train), "sha256": corpus.fingerprint}
    return TrainingData(tokenizer=tokenizer, train=train, valid=valid, fingerprint=fingerprint, corpus=corpus)
