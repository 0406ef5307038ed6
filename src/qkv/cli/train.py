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
import signal
import sys
import threading
from dataclasses import fields
from pathlib import Path

import torch

from qkv.cli.options import positive_int, set_threads
from qkv.data.text import TEXT_SOURCES
from qkv.runs.recipes import RECIPES, translation_recipes

# command-line option -> (TransformerConfig field, CausalLMConfig field, type, help); None where the
# option does not apply to that kind of model (None everywhere = keep the recipe's value)
MODEL_OPTIONS = {
    "d_model": ("d_model", "d_model", int, "model width"),
    "heads": ("num_heads", "num_heads", int, "attention heads; must divide --d-model"),
    "encoder_layers": ("num_encoder_layers", None, int, "encoder layers (translation)"),
    "decoder_layers": ("num_decoder_layers", None, int, "decoder layers (translation)"),
    "layers": (None, "num_layers", int, "layers of a language model"),
    "d_ff": ("d_ff", "d_ff", int, "inner width of the feed-forward layers"),
    "dropout": ("dropout", "dropout", float, "residual and embedding dropout, in [0, 1)"),
    "attention_dropout": (
        "attention_dropout",
        "attention_dropout",
        float,
        "dropout on the attention weights, in [0, 1) (not in the paper; default 0)",
    ),
    "activation": ("activation", "activation", str, "feed-forward activation: relu, gelu or gelu_tanh"),
    "norm_first": ("norm_first", "norm_first", bool, "pre-LN instead of the paper's post-LN"),
    "max_len": (
        "max_len",
        None,
        int,
        "longest sequence in tokens (translation; longer training pairs are dropped, with a count)",
    ),
    "context": (None, "context", int, "tokens a language model attends over (its training windows)"),
    "share_embeddings": ("share_embeddings", None, bool, "one embedding table for source and target"),
}
LM_OPTIONS = ("tokenizer", "windows")  # language-model options that are neither model nor TrainConfig fields
TASKS = ("translation", "lm")
DATA_OPTIONS = (
    "task",
    "data",
    "prepared",
    "data_dir",
    "src_lang",
    "tgt_lang",
    "train_src",
    "train_tgt",
    "val_src",
    "val_tgt",
    "train_text",
    "val_text",
    "test_text",
    "vocab_size",
    "recipe",
    "both_directions",
    *LM_OPTIONS,
)


def _train_fields():
    """The :class:`~qkv.training.TrainConfig` fields that are command-line options, with their flags."""
    from qkv.training import TrainConfig

    for f in fields(TrainConfig):
        if f.metadata.get("cli"):
            yield f, f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data (one of --data, --prepared, --train-src/--train-tgt or --train-text)")
    data.add_argument(
        "--task",
        choices=TASKS,
        help="what to train (default: what the data is for: a language "
        "model for tinyshakespeare and --train-text, else translation); "
        "given, it must agree with the data",
    )
    data.add_argument(
        "--data",
        choices=["multi30k", "dates", "tinyshakespeare"],
        help="a known data set (tinyshakespeare: a language model)",
    )
    data.add_argument(
        "--prepared",
        metavar="DIR",
        help="a prepared folder made by qkv prepare (its tokenizer, training and validation pairs; "
        "every process reads it a batch at a time)",
    )
    data.add_argument(
        "--data-dir",
        help="folder with the Multi30k files or tiny Shakespeare's input.txt (default: "
        "$QKV_DATA/multi30k or $QKV_DATA/tinyshakespeare, the cache, or a download)",
    )
    data.add_argument("--src-lang", choices=["en", "de", "fr"], help="Multi30k source language (default en)")
    data.add_argument("--tgt-lang", choices=["en", "de", "fr"], help="Multi30k target language (default de)")
    data.add_argument(
        "--both-directions",
        action="store_true",
        default=None,
        help="translation from text: train on the pairs and on the same pairs reversed (one model "
        "for both ways; validation stays in the given direction)",
    )
    data.add_argument("--train-src", help="training source file, one sentence a line (.gz allowed)")
    data.add_argument("--train-tgt", help="training target file, line-aligned with --train-src")
    data.add_argument("--val-src", help="validation source file (optional)")
    data.add_argument("--val-tgt", help="validation target file")
    data.add_argument("--train-text", help="UTF-8 text to train a language model on")
    data.add_argument(
        "--val-text",
        help="validation text (default: --train-text is cut by position: its first 90%% "
        "of characters train, the next 5%% validate, the last 5%% are the test split)",
    )
    data.add_argument(
        "--test-text",
        help="test text, with --val-text (without it, the run has no test split); "
        "training never reads it: qkv evaluate scores it",
    )
    data.add_argument(
        "--tokenizer",
        choices=["char", "bpe"],
        help="a language model's tokens: characters (default) or byte-level BPE (--vocab-size)",
    )
    data.add_argument(
        "--windows",
        choices=["random", "strided"],
        help="a language model's training windows: random offsets (default) or non-overlapping",
    )
    run = parser.add_argument_group("run folder")
    run.add_argument(
        "--run-dir", required=True, help="the run folder (created; it must not exist unless --resume or --overwrite)"
    )
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir where it stopped")
    run.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="with --resume: load a state.pt that holds pickled Python objects (written by an older "
        "qkv) in full, once, and rewrite it in the safe form; loading such a file can run any "
        "code, so only for a run you made yourself",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --run-dir if it is a qkv run folder (or empty), once every check has passed",
    )
    model = parser.add_argument_group("model (defaults: the data set's recipe; fixed once a run exists)")
    model.add_argument(
        "--recipe",
        choices=translation_recipes(),
        help="train with this recipe instead of the data set's: paper-base / paper-big are the "
        "paper's WMT 2014 models (Table 3; ~25k tokens a step over max_tokens x accum_steps x "
        "processes, set for the number of processes unless --max-tokens/--accum-steps say)",
    )
    add_model_arguments(model)
    add_train_arguments(parser.add_argument_group("training (defaults: the recipe; with --resume: the run's own)"))
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_model_arguments(group, *, translation_only: bool = False) -> None:
    """``--vocab-size`` and the model options (:data:`MODEL_OPTIONS`; with ``translation_only``, those
    of a translation model): declared here once, for ``qkv train`` and the training benchmarks."""
    group.add_argument(
        "--vocab-size",
        type=int,
        help="BPE vocabulary (recipe: 8000; dates 600; a language model with --tokenizer bpe 2000)",
    )
    for option, (translation_field, _, kind, help_text) in MODEL_OPTIONS.items():
        if translation_only and translation_field is None:
            continue
        if kind is bool:
            group.add_argument(_flag(option), action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(_flag(option), type=kind, help=help_text)


def add_train_arguments(group) -> None:
    """One option per :class:`~qkv.training.TrainConfig` field marked for the command line (each
    declared once, on the field), defaulting to None: the recipe's value."""
    for f, flag in _train_fields():
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=f.metadata["help"])
        elif f.metadata.get("choices"):
            group.add_argument(flag, dest=f.name, choices=f.metadata["choices"], help=f.metadata["help"])
        else:
            group.add_argument(flag, dest=f.name, type=int if f.type == "int" else float, help=f.metadata["help"])


def train_options_from(args: argparse.Namespace) -> dict:
    """The :class:`~qkv.training.TrainConfig` fields given on the command line."""
    return {f.name: getattr(args, f.name) for f, _ in _train_fields() if getattr(args, f.name) is not None}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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


def data_spec(args: argparse.Namespace) -> dict:
    """The data spec (:mod:`qkv.data.sources`, :mod:`qkv.data.text`) the options describe; ``--task``,
    when given, must name what that data trains."""
    spec = _data_spec(args)
    task = "lm" if spec["source"] in TEXT_SOURCES else "translation"
    if args.task is not None and args.task != task:
        given = {
            "tinyshakespeare": "--data tinyshakespeare",
            "text": "--train-text",
            "prepared": "--prepared (a parallel corpus)",
            "files": "--train-src/--train-tgt",
        }.get(spec["source"], f"--data {args.data}")
        raise ValueError(
            f"--task {args.task} does not fit {given}, which trains "
            f"{'a language model' if task == 'lm' else 'a translation model'}: use --task {task}, or "
            f"{'--train-text FILE / --data tinyshakespeare' if args.task == 'lm' else 'parallel data'}"
        )
    return spec


def _data_spec(args: argparse.Namespace) -> dict:
    spec = _source_spec(args)
    return {**spec, "both_directions": True} if args.both_directions else spec  # start_run checks where it fits


def _source_spec(args: argparse.Namespace) -> dict:
    files = [args.train_src, args.train_tgt, args.val_src, args.val_tgt]
    texts = [args.train_text, args.val_text, args.test_text]
    if sum(bool(x) for x in (args.data, args.prepared, any(files), any(texts))) > 1:
        raise ValueError("give one of --data, --prepared, --train-src/--train-tgt files or --train-text, not several")
    is_lm = args.data == "tinyshakespeare" or any(texts)
    if not is_lm:
        for name in LM_OPTIONS:
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} is for a language model (--data tinyshakespeare or --train-text)")
    if args.data not in ("multi30k", "tinyshakespeare") and args.data_dir is not None:
        raise ValueError("--data-dir is for --data multi30k or tinyshakespeare")
    if args.data != "multi30k":
        for name in ("src_lang", "tgt_lang"):
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} is for --data multi30k only")
    if args.data == "tinyshakespeare":
        return {"source": "tinyshakespeare", "folder": _data_dir(args)}
    if args.prepared:
        return {"source": "prepared", "folder": _prepared_folder(args.prepared)}
    if any(texts):
        if not args.train_text:
            raise ValueError(f"{'--val-text' if args.val_text else '--test-text'} needs --train-text")
        if args.test_text and not args.val_text:
            raise ValueError(
                "--test-text needs --val-text (without --val-text, the last 5% of --train-text is the "
                "test split and the 5% before it validates)"
            )
        return {
            "source": "text",
            **{
                k: (str(Path(f).resolve()) if f else None)
                for k, f in zip(("train_text", "val_text", "test_text"), texts)
            },
        }
    if args.data == "multi30k":
        folder = _data_dir(args)
        src, tgt = args.src_lang or "en", args.tgt_lang or "de"
        if src == tgt:
            raise ValueError(f"--src-lang and --tgt-lang are both {src!r}")
        return {"source": "multi30k", "folder": folder, "src_lang": src, "tgt_lang": tgt}
    if args.data == "dates":
        return {"source": "dates", "train_size": 20000, "valid_size": 1000, "seed": args.seed or 0}
    if not (args.train_src and args.train_tgt):
        raise ValueError(
            "no training data: pass --data multi30k/dates/tinyshakespeare, --prepared DIR, --train-src "
            "and --train-tgt, or --train-text"
        )
    keys = ("train_src", "train_tgt", "val_src", "val_tgt")
    return {"source": "files", **{k: (str(Path(f).resolve()) if f else None) for k, f in zip(keys, files)}}


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from qkv.runs.translation import resume_run, start_run
    from qkv.runtime.device import pick_device
    from qkv.training.distributed import init_distributed, shutdown

    set_threads(args.threads)  # under torchrun, OMP_NUM_THREADS (1 by default) sets each process's share
    train_options = train_options_from(args)
    if args.no_progress or not sys.stderr.isatty():
        train_options["progress"] = False
    if args.resume:
        fixed = [_flag(opt) for opt in MODEL_OPTIONS if getattr(args, opt) is not None]
        fixed += [_flag(opt) for opt in DATA_OPTIONS if getattr(args, opt) is not None]
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
        model_options = model_options_from(args, is_lm=spec["source"] in TEXT_SOURCES)
        vocab_size, recipe_note, decode = args.vocab_size, None, None
        if args.recipe:  # the named recipe in place of the data's; explicit options still go over it
            model_options, train_options, vocab_size, recipe_note = _with_recipe(
                args, spec, model_options, train_options
            )
            decode = RECIPES[args.recipe].get("decode")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one process of several
        dist = init_distributed(args.device)
        if not dist.is_main:
            logging.getLogger("qkv").setLevel(logging.WARNING)  # rank 0 reports for everyone
    else:
        dist = None
        pick_device(args.device)
    if not args.resume and recipe_note:
        logging.getLogger("qkv.cli.train").info(recipe_note)
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
                decode=decode,
            )
        return _train(trainer, args.run_dir)
    finally:
        shutdown()


def _with_recipe(
    args: argparse.Namespace, spec: dict, model_options: dict, train_options: dict
) -> tuple[dict, dict, int, str]:
    """Model options, training options and vocabulary size of ``--recipe`` (under the explicit
    options), and a line saying how a step's tokens are split."""
    import os

    from qkv.data.sources import recipe_source
    from qkv.runs.recipes import recipe_overrides

    world = int(os.environ.get("WORLD_SIZE", "1"))
    recipe_model, recipe_train, recipe_vocab = recipe_overrides(
        args.recipe,
        recipe_source(spec["source"]),
        world_size=world,
        max_tokens=args.max_tokens,
        accum_steps=args.accum_steps,
    )
    train_options = {**recipe_train, **train_options}
    note = f"recipe {args.recipe}"
    if "tokens_per_step" in RECIPES[args.recipe]:
        max_tokens, accum = train_options["max_tokens"], train_options["accum_steps"]
        note += (
            f": a step is {world} process(es) x {accum} batch(es) x {max_tokens} padded tokens = "
            f"{world * accum * max_tokens} (the recipe's {RECIPES[args.recipe]['tokens_per_step']})"
        )
    vocab_size = recipe_vocab if args.vocab_size is None else args.vocab_size
    return {**recipe_model, **model_options}, train_options, vocab_size, note


def model_options_from(args: argparse.Namespace, *, is_lm: bool) -> dict:
    """The model options given, as fields of the kind of model the data trains; an option of the
    other kind is an error."""
    options = {}
    for opt, (translation_field, lm_field, _, _) in MODEL_OPTIONS.items():
        if getattr(args, opt, None) is None:  # not given (or not declared: add_model_arguments(translation_only))
            continue
        field = lm_field if is_lm else translation_field
        if field is None:
            kind = "a language model" if is_lm else "a translation model"
            raise ValueError(f"{_flag(opt)} is not an option of {kind}")
        options[field] = getattr(args, opt)
    return options


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a cluster scheduler's preemption, torchrun passing one on) during training:
    raised like Ctrl-C, so the trainer saves the last whole step before the process ends."""


@contextlib.contextmanager
def sigterm_saves_first():
    """While training, SIGTERM raises :class:`Terminated` in the main thread; a second SIGTERM is
    ignored so that it cannot cut the checkpoint short (SIGKILL still ends the process). Once the
    block is left, SIGTERM stays ignored until the caller's ``finally`` restores the old handler:
    the line that says what the run folder holds is printed even when torchrun's SIGTERM (after a
    lost rank) lands while it is being written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def sigterm_restored():
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


def _train(trainer, run_dir: str) -> int:
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
                f"trained {s.step} steps ({s.seconds / 60:.1f} min, {s.tokens / max(s.seconds, 1e-9):.0f} "
                f"target tokens/s) on {trainer.dist.world_size} process(es); wrote {path}",
                file=sys.stderr,
            )
        return 0
