"""``qkv train``: train a translation model or a language model into a run folder.

    qkv train --data multi30k --src-lang en --tgt-lang de --run-dir runs/en-de --minutes 60
    qkv train --train-src train.en --train-tgt train.de --val-src val.en --val-tgt val.de --run-dir runs/mine
    qkv train --prepared wmt14/prepared --recipe paper-base --run-dir runs/base   # a folder made by qkv prepare
    qkv train --data dates --run-dir runs/dates
    qkv train --task lm --data tinyshakespeare --run-dir runs/shakespeare  # a character-level language model
    qkv train --train-text corpus.txt --tokenizer bpe --vocab-size 4000 --run-dir runs/lm
    qkv train --run-dir runs/en-de --resume --minutes 90      # continue (the budget counts all sessions)
    torchrun --nproc_per_node 8 -m qkv train --prepared wmt14/prepared --recipe paper-base --run-dir runs/base

Every option and input is checked before the run folder is written. Ctrl-C (or SIGTERM) saves a checkpoint
first, and so does a failed step; ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch

from qkv.cli.options import set_threads
from qkv.cli.train_options import (  # re-exported: the training benchmarks declare qkv train's options
    DATA_OPTIONS,
    GROUP_TITLES,
    LM_OPTIONS,
    MODEL_OPTIONS,
    add_cli_options,
    add_model_arguments,
    add_train_arguments,
    flag_of,
    model_options_from,
    train_options_from,
)
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import check_vocab_size
from qkv.runs.kinds import kind_for_source
from qkv.runs.language_model import LANGUAGE_MODEL
from qkv.training.config import TrainConfig

if TYPE_CHECKING:
    from qkv.training import Trainer

# the options are declared in qkv.cli.train_options (data and run options, model options, and the
# TrainConfig fields' metadata), each with its help group; --help and --help-all in qkv.cli.train_help
OWN_HELP = True  # qkv.cli.build_parser: this command adds its own -h/--help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``qkv train``'s options, by group: ``--help`` lists data, model, training and run, the
    options most runs need; ``--help-all`` adds the advanced options and the research methods."""
    from qkv.cli.train_help import DEFAULT_DATA, FullHelp, ShortHelp, default_notes, recipe_in_view

    parser.usage = (
        "%(prog)s (--data NAME | --prepared DIR | --train-src FILE --train-tgt FILE | --train-text FILE)\n"
        "                 --run-dir DIR [OPTION ...]\n"
        "       %(prog)s --run-dir DIR --resume [OPTION ...]"
    )
    parser.add_argument("-h", "--help", action=ShortHelp, help="show the options most runs need and exit")
    parser.add_argument("--help-all", action=FullHelp, help="show every option, research methods included, and exit")
    groups = {name: parser.add_argument_group(title) for name, title in GROUP_TITLES.items()}
    # the reference (qkv.cli.reference) shows the default data's recipe; --help the one the command line names
    notes = default_notes(recipe_in_view(["--data", DEFAULT_DATA]))
    add_cli_options(groups, notes=notes)
    add_model_arguments(groups, notes=notes)
    add_train_arguments(groups, notes=notes)
    groups["run"].add_argument(
        "--recipe",
        metavar="NAME|FILE.toml",
        help="train with this recipe instead of the data set's (the same run on every machine; "
        "options given here still win): a name from qkv recipes, e.g. multi30k-bf16 (Multi30k where "
        "bf16 is fast) or paper-base / paper-big (the paper's WMT 2014 models, ~25k tokens a step over "
        "max_tokens x accum_steps x processes, set for the number of processes unless "
        "--max-tokens/--accum-steps say), or a recipe file of your own (qkv recipes show NAME --toml)",
    )


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


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from qkv.runs.translation import resume_run, start_run
    from qkv.runtime.device import pick_device
    from qkv.training.distributed import init_distributed, shutdown

    set_threads(args.threads)  # under torchrun, OMP_NUM_THREADS (1 by default) sets each process's share
    train_options = train_options_from(args)
    for name, value in train_options.items():  # each in its field's range before anything uses it (--seed)
        TrainConfig.check_option(name, value)
    if args.vocab_size is not None and not args.resume:  # (a resumed run refuses it below)
        check_vocab_size(args.vocab_size)
    if args.no_progress or not sys.stderr.isatty():
        train_options["progress"] = False
    if args.resume:
        fixed = [flag_of(opt) for opt in MODEL_OPTIONS if getattr(args, opt) is not None]
        fixed += [flag_of(opt) for opt in DATA_OPTIONS if getattr(args, opt) is not None]
        if args.overwrite:
            raise ValueError("--resume continues a run and --overwrite replaces it: give one of them")
        if fixed:
            raise ValueError(
                f"{', '.join(fixed)}: a resumed run keeps the model and data it started with; "
                "drop these options, or start a new --run-dir"
            )
        if not Path(args.run_dir).is_dir():
            raise FileNotFoundError(f"{args.run_dir}: no run folder to resume")
    elif args.trust_checkpoint:
        raise ValueError("--trust-checkpoint converts the checkpoint of a run being resumed: give it with --resume")
    else:
        spec = data_spec(args)
        model_options = model_options_from(args, is_lm=kind_for_source(spec.source) is LANGUAGE_MODEL)
        vocab_size = args.vocab_size
        if args.recipe:  # the named recipe in place of the data's; explicit options still go over it
            _check_recipe(args, spec)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one process of several
        dist = init_distributed(args.device)
        if not dist.is_main:
            logging.getLogger("qkv").setLevel(logging.WARNING)  # rank 0 reports for everyone
    else:
        dist = None
        pick_device(args.device)
    try:
        if args.resume:
            trainer = resume_run(
                args.run_dir,
                train_options=train_options,
                device=args.device,
                dist=dist,
                trust_checkpoint=args.trust_checkpoint,
            )
        else:
            torch.manual_seed(args.seed or 0)
            lm_options = {k: getattr(args, k) for k in LM_OPTIONS if getattr(args, k) is not None}
            trainer = start_run(
                args.run_dir,
                data=spec,
                model_options=model_options,
                train_options=train_options,
                vocab_size=vocab_size,
                lm_options=lm_options,
                overwrite=args.overwrite,
                device=args.device,
                dist=dist,
                recipe=args.recipe,
            )
        return _train(trainer, args.run_dir)
    finally:
        shutdown()


def _check_recipe(args: argparse.Namespace, spec: DataSpec) -> None:
    """``--recipe`` read and checked against the data before anything starts; start_run trains with
    it, resolving the explicit options over it once (:func:`qkv.runs.resolve.resolve_run_options`)
    and printing the result as the run's first lines."""
    from qkv.runs.recipes.choice import choose_recipe

    choose_recipe(args.recipe, spec.source)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a cluster scheduler's preemption, torchrun passing one on) during training:
    raised like Ctrl-C, so the trainer saves the last whole step before the process ends."""


@contextlib.contextmanager
def sigterm_saves_first() -> Iterator[None]:
    """While training, SIGTERM raises :class:`Terminated` in the main thread; a second SIGTERM is
    ignored so that it cannot cut the checkpoint short (SIGKILL still ends the process). Once the
    block is left, SIGTERM stays ignored until the caller's ``finally`` restores the old handler:
    the line that says what the run folder holds is printed even when torchrun's SIGTERM (after a
    lost rank) lands while it is being written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def sigterm_restored() -> Iterator[None]:
    """Put back the SIGTERM handler found on entry when the block ends (see :func:`sigterm_saves_first`)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _what_is_saved(run_dir: str, step: int) -> str:
    """What the run folder holds after a stop, read back from ``state.pt`` (a save that failed, on a
    full disk or with a process gone, leaves the previous checkpoint: say which step that is)."""
    from qkv.training.checkpoint_files import saved_step

    on_disk = saved_step(run_dir)
    if on_disk == step:
        return f"checkpoint saved at step {step}"
    if on_disk is None:
        return f"the checkpoint of step {step} could not be saved and the run folder holds no readable one"
    return f"the checkpoint of step {step} could not be saved; the run folder holds step {on_disk}"


def _train(trainer: Trainer, run_dir: str) -> int:
    """Run the loop; report Ctrl-C or SIGTERM and a failed step in one line each (rank 0 speaks for all)."""
    from qkv.runs.translation import TrainingCrashed, run_training

    with sigterm_restored():
        try:
            with sigterm_saves_first():
                path = run_training(trainer)
        except KeyboardInterrupt as err:
            if trainer.dist.is_main:
                what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
                print(
                    f"{what}: {_what_is_saved(run_dir, trainer.state.step)}; continue with "
                    f"qkv train --run-dir {run_dir} --resume",
                    file=sys.stderr,
                )
            return 128 + signal.SIGTERM if isinstance(err, Terminated) else 130
        except TrainingCrashed as err:
            print(
                f"qkv train: error: {err}; {_what_is_saved(run_dir, err.step)}: after fixing the cause, "
                f"continue with qkv train --run-dir {run_dir} --resume",
                file=sys.stderr,
            )
            return 1
        s = trainer.state
        if trainer.dist.is_main:
            print(
                f"trained {s.step} step{'' if s.step == 1 else 's'} ({s.seconds / 60:.1f} min, "
                f"{s.tokens / max(s.seconds, 1e-9):.0f} target tokens/s) on {trainer.dist.world_size} "
                f"process{'' if trainer.dist.world_size == 1 else 'es'}, {trainer.stopped_by()}; wrote {path}",
                file=sys.stderr,
            )
        return 0
