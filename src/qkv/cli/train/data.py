"""``qkv train``'s data options as a :class:`~qkv.data.spec.DataSpec`: which source the command line
names (one of ``--data``, ``--prepared``, ``--train-src``/``--train-tgt``, ``--train-text``), each
option checked against that source before anything is written."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from qkv.cli.train.options import LM_OPTIONS, flag_of
from qkv.data.spec import DataSpec
from qkv.runs.kinds import kind_for_source


def _data_dir(args: argparse.Namespace) -> str | None:
    if not args.data_dir:
        return None
    folder = Path(args.data_dir).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"{args.data_dir}: --data-dir is not a folder")
    return str(folder)


def _prepared_folder(folder: str) -> str:
    """``--prepared``'s folder, resolved; a missing folder or one ``qkv prepare`` did not finish is an error."""
    from qkv.data.prepared import PreparedCorpus

    PreparedCorpus(folder)  # raises, naming the folder, when there is no complete manifest
    return str(Path(folder).resolve())


def data_spec(args: argparse.Namespace) -> DataSpec:
    """The data spec (:mod:`qkv.data.sources`, :mod:`qkv.data.text`) the options describe; ``--task``,
    when given, must name what that data trains."""
    spec = _data_spec(args)
    task = kind_for_source(spec.source).name
    if args.task is not None and args.task != task:
        given = {
            "tinyshakespeare": "--data tinyshakespeare",
            "text": "--train-text",
            "prepared": "--prepared (a parallel corpus)",
            "files": "--train-src/--train-tgt",
        }.get(spec.source, f"--data {args.data}")
        raise ValueError(
            f"--task {args.task} does not fit {given}, which trains "
            f"{'a language model' if task == 'lm' else 'a translation model'}: use --task {task}, or "
            f"{'--train-text FILE / --data tinyshakespeare' if args.task == 'lm' else 'parallel data'}"
        )
    return spec


def _data_spec(args: argparse.Namespace) -> DataSpec:
    spec = _source_spec(args)
    return replace(spec, both_directions=True) if args.both_directions else spec  # start_run checks where it fits


def _source_spec(args: argparse.Namespace) -> DataSpec:
    files = [args.train_src, args.train_tgt, args.val_src, args.val_tgt]
    texts = [args.train_text, args.val_text, args.test_text]
    if sum(bool(x) for x in (args.data, args.prepared, any(files), any(texts))) > 1:
        raise ValueError("give one of --data, --prepared, --train-src/--train-tgt files or --train-text, not several")
    is_lm = args.data == "tinyshakespeare" or any(texts)
    if not is_lm:
        for name in LM_OPTIONS:
            if getattr(args, name) is not None:
                raise ValueError(f"{flag_of(name)} is for a language model (--data tinyshakespeare or --train-text)")
    if args.data not in ("multi30k", "tinyshakespeare") and args.data_dir is not None:
        raise ValueError("--data-dir is for --data multi30k or tinyshakespeare")
    if args.data != "multi30k":
        for name in ("src_lang", "tgt_lang"):
            if getattr(args, name) is not None:
                raise ValueError(f"{flag_of(name)} is for --data multi30k only")
    if args.data == "tinyshakespeare":
        return DataSpec(source="tinyshakespeare", folder=_data_dir(args))
    if args.prepared:
        return DataSpec(source="prepared", folder=_prepared_folder(args.prepared))
    if any(texts):
        if not args.train_text:
            raise ValueError(f"{'--val-text' if args.val_text else '--test-text'} needs --train-text")
        if args.test_text and not args.val_text:
            raise ValueError(
                "--test-text needs --val-text (without --val-text, the last 5% of --train-text is the "
                "test split and the 5% before it validates)"
            )
        train_text, val_text, test_text = (_data_path(f) if f else None for f in texts)
        return DataSpec(source="text", train_text=train_text, val_text=val_text, test_text=test_text)
    if args.data == "multi30k":
        folder = _data_dir(args)
        src, tgt = args.src_lang or "en", args.tgt_lang or "de"
        if src == tgt:
            raise ValueError(f"--src-lang and --tgt-lang are both {src!r}")
        return DataSpec(source="multi30k", folder=folder, src_lang=src, tgt_lang=tgt)
    if args.data == "dates":
        return DataSpec(source="dates", train_size=20000, valid_size=1000, seed=args.seed or 0)
    if not (args.train_src and args.train_tgt):
        raise ValueError(
            "no training data: pass --data multi30k/dates/tinyshakespeare, --prepared DIR, --train-src "
            "and --train-tgt, or --train-text"
        )
    train_src, train_tgt, val_src, val_tgt = (_data_path(f) if f else None for f in files)
    return DataSpec(source="files", train_src=train_src, train_tgt=train_tgt, val_src=val_src, val_tgt=val_tgt)


def _data_path(name: str) -> str:
    """A data file's absolute path as the run records it: links resolved for a file, while a pipe
    (``<(zcat corpus.gz)``, a FIFO) keeps the name given, whose resolved ``/proc`` target cannot be
    opened."""
    from qkv.runtime.fileio import is_special_file

    return os.path.abspath(name) if is_special_file(name) else str(Path(name).resolve())
