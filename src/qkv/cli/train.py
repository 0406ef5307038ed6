"""``qkv train``: train a translation model into a run folder.

    qkv train --data multi30k --src-lang en --tgt-lang de --run-dir runs/en-de --minutes 60
    qkv train --train-src train.en --train-tgt train.de --val-src val.en --val-tgt val.de --run-dir runs/mine
    qkv train --data dates --run-dir runs/dates
    qkv train --run-dir runs/en-de --resume --minutes 90      # continue (the budget counts all sessions)

Ctrl-C saves a checkpoint first; ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# command-line option -> TrainConfig field (None = keep the recipe's / the saved run's value)
TRAIN_OPTIONS = {
    "max_tokens": "max_tokens", "accum_steps": "accum_steps", "warmup": "warmup_steps", "lr_factor": "lr_factor",
    "label_smoothing": "label_smoothing", "clip_norm": "clip_norm", "bf16": "bf16", "compile": "compile",
    "minutes": "max_minutes",
    "max_steps": "max_steps", "epochs": "max_epochs", "eval_every_minutes": "eval_every_minutes",
    "eval_every_steps": "eval_every_steps", "eval_sentences": "eval_sentences",
    "checkpoint_every_minutes": "checkpoint_every_minutes", "checkpoint_every_steps": "checkpoint_every_steps",
    "average_last": "average_last", "seed": "seed",
}
MODEL_OPTIONS = {
    "d_model": "d_model", "heads": "num_heads", "encoder_layers": "num_encoder_layers",
    "decoder_layers": "num_decoder_layers", "d_ff": "d_ff", "dropout": "dropout", "activation": "activation",
    "norm_first": "norm_first", "max_len": "max_len", "share_embeddings": "share_embeddings",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data (one of --data or --train-src/--train-tgt)")
    data.add_argument("--data", choices=["multi30k", "dates"], help="a known data set")
    data.add_argument("--data-dir", help="folder with the Multi30k files (default: $QKV_DATA/multi30k, the cache, "
                                         "or a download)")
    data.add_argument("--src-lang", default="en", help="Multi30k source language (en, de, fr; default en)")
    data.add_argument("--tgt-lang", default="de", help="Multi30k target language (default de)")
    data.add_argument("--train-src", help="training source file, one sentence a line (.gz allowed)")
    data.add_argument("--train-tgt", help="training target file, line-aligned with --train-src")
    data.add_argument("--val-src", help="validation source file (optional)")
    data.add_argument("--val-tgt", help="validation target file")
    run = parser.add_argument_group("run folder")
    run.add_argument("--run-dir", required=True, help="the run folder (created; it must not exist unless "
                                                      "--resume or --overwrite)")
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir where it stopped")
    run.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    model = parser.add_argument_group("model (defaults: the data set's recipe)")
    model.add_argument("--vocab-size", type=int, help="joint BPE vocabulary (recipe: 8000; dates 600)")
    model.add_argument("--d-model", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--encoder-layers", type=int)
    model.add_argument("--decoder-layers", type=int)
    model.add_argument("--d-ff", type=int)
    model.add_argument("--dropout", type=float)
    model.add_argument("--activation", choices=["relu", "gelu", "gelu_tanh"])
    model.add_argument("--norm-first", action=argparse.BooleanOptionalAction, help="pre-LN instead of post-LN")
    model.add_argument("--max-len", type=int, help="longest sequence in tokens")
    model.add_argument("--share-embeddings", action=argparse.BooleanOptionalAction)
    train = parser.add_argument_group("training (defaults: the recipe; with --resume: the run's own)")
    train.add_argument("--minutes", type=float, help="stop after this much training time, over all sessions")
    train.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    train.add_argument("--epochs", type=float, help="stop after this many passes over the data")
    train.add_argument("--max-tokens", type=int, help="padded tokens per batch")
    train.add_argument("--accum-steps", type=int, help="batches per optimizer step (gradient accumulation)")
    train.add_argument("--warmup", type=int, help="warmup steps of the inverse-sqrt schedule")
    train.add_argument("--lr-factor", type=float, help="multiplies the paper's learning-rate schedule")
    train.add_argument("--label-smoothing", type=float)
    train.add_argument("--clip-norm", type=float, help="gradient clipping on the global norm (0 = off)")
    train.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                       help="bfloat16 autocast (default: the recipe's; Multi30k uses it where bf16 matrix "
                            "products are fast, i.e. CUDA or CPUs with AVX512-BF16/AMX)")
    train.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="torch.compile the encoder and decoder (default: off; on a 2-core CPU it made "
                            "the step slower, see the README's performance section)")
    train.add_argument("--eval-every-minutes", type=float)
    train.add_argument("--eval-every-steps", type=int)
    train.add_argument("--eval-sentences", type=int, help="validation sentences decoded for BLEU")
    train.add_argument("--checkpoint-every-minutes", type=float)
    train.add_argument("--checkpoint-every-steps", type=int)
    train.add_argument("--average-last", type=int, help="average this many last checkpoints at the end")
    train.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _chosen(args: argparse.Namespace, names: dict) -> dict:
    return {field: getattr(args, opt) for opt, field in names.items() if getattr(args, opt) is not None}


def data_spec(args: argparse.Namespace) -> dict:
    """The data spec (:mod:`qkv.data.sources`) the options describe."""
    files = [args.train_src, args.train_tgt, args.val_src, args.val_tgt]
    if args.data and any(files):
        raise ValueError("give either --data or --train-src/--train-tgt files, not both")
    if args.data == "multi30k":
        folder = str(Path(args.data_dir).resolve()) if args.data_dir else None
        return {"source": "multi30k", "folder": folder, "src_lang": args.src_lang, "tgt_lang": args.tgt_lang}
    if args.data == "dates":
        return {"source": "dates", "train_size": 20000, "valid_size": 500, "seed": args.seed or 0}
    if not (args.train_src and args.train_tgt):
        raise ValueError("no training data: pass --data multi30k, --data dates, or --train-src and --train-tgt")
    keys = ("train_src", "train_tgt", "val_src", "val_tgt")
    return {"source": "files", **{k: (str(Path(f).resolve()) if f else None) for k, f in zip(keys, files)}}


def run(args: argparse.Namespace) -> int:
    from qkv.training import resume_run, run_training, start_run

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    train_options = _chosen(args, TRAIN_OPTIONS)
    if args.no_progress or not sys.stderr.isatty():
        train_options["progress"] = False
    if args.resume:
        if not Path(args.run_dir).is_dir():
            raise FileNotFoundError(f"{args.run_dir}: no run folder to resume")
        trainer = resume_run(args.run_dir, train_options=train_options, device=device)
    else:
        torch.manual_seed(args.seed or 0)
        trainer = start_run(args.run_dir, data=data_spec(args), model_options=_chosen(args, MODEL_OPTIONS),
                            train_options=train_options, vocab_size=args.vocab_size, overwrite=args.overwrite,
                            device=device)
    try:
        path = run_training(trainer)
    except KeyboardInterrupt:
        print(f"interrupted: checkpoint saved at step {trainer.state.step}; continue with "
              f"qkv train --run-dir {args.run_dir} --resume", file=sys.stderr)
        return 130
    s = trainer.state
    print(f"trained {s.step} steps ({s.seconds / 60:.1f} min, {s.tokens / max(s.seconds, 1e-9):.0f} target tokens/s);"
          f" wrote {path}", file=sys.stderr)
    return 0
