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

The command is a package, split where the concept splits: :mod:`qkv.cli.train.options` declares
every option once (data and run options, model options, the TrainConfig fields' metadata), each
with its help group; :mod:`qkv.cli.train.help` writes ``--help`` and ``--help-all``;
:mod:`qkv.cli.train.data` turns the data options into a :class:`~qkv.data.spec.DataSpec`;
:mod:`qkv.cli.train.stopping` runs the loop and reports how it stopped. This module is the command
(``add_arguments`` and ``run``) and keeps every name the single ``train.py`` had for its importers
(the training benchmarks declare qkv train's options from here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from qkv.cli.options import set_threads
from qkv.cli.train.data import data_spec
from qkv.cli.train.options import (
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
from qkv.cli.train.stopping import Terminated, sigterm_restored, sigterm_saves_first, train_and_report
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import check_vocab_size
from qkv.runs.kinds import kind_for_source
from qkv.runs.language_model import LANGUAGE_MODEL
from qkv.training.config import TrainConfig

__all__ = [
    "DATA_OPTIONS",
    "GROUP_TITLES",
    "LM_OPTIONS",
    "MODEL_OPTIONS",
    "OWN_HELP",
    "Terminated",
    "add_arguments",
    "add_cli_options",
    "add_model_arguments",
    "add_train_arguments",
    "data_spec",
    "flag_of",
    "model_options_from",
    "run",
    "sigterm_restored",
    "sigterm_saves_first",
    "train_and_report",
    "train_options_from",
]

OWN_HELP = True  # qkv.cli.build_parser: this command adds its own -h/--help
_train = train_and_report  # its name while the command was one file (tests/test_newcomer.py imports it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``qkv train``'s options, by group: ``--help`` lists data, model, training and run, the
    options most runs need; ``--help-all`` adds the advanced options and the research methods."""
    from qkv.cli.train.help import DEFAULT_DATA, FullHelp, ShortHelp, default_notes, recipe_in_view

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


def run(args: argparse.Namespace) -> int:
    """Check every option and input, then start (or resume) the run in ``--run-dir`` and train it.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code (see :func:`~qkv.cli.train.stopping.train_and_report`).
    """
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
        _check_resume(args)
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
        return train_and_report(trainer, args.run_dir)
    finally:
        shutdown()


def _check_resume(args: argparse.Namespace) -> None:
    """``--resume`` refuses what a resumed run cannot change (its model and data), ``--overwrite``, and
    a ``--run-dir`` that is not there."""
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


def _check_recipe(args: argparse.Namespace, spec: DataSpec) -> None:
    """``--recipe`` read and checked against the data before anything starts; start_run trains with
    it, resolving the explicit options over it once (:func:`qkv.runs.resolve.resolve_run_options`)
    and printing the result as the run's first lines."""
    from qkv.runs.recipes.choice import choose_recipe

    choose_recipe(args.recipe, spec.source)
