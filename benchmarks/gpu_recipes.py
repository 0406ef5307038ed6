"""Choose the recipes for one GPU on validation, then score their test split once: Multi30k En->De
(``multi30k-gpu``, 10 minutes; the target is test 2016 sacreBLEU >= 41) and tiny Shakespeare
characters (``tinyshakespeare-gpu``, 5 minutes; the target is validation <= 1.47 nats/char, nanoGPT's
published figure for its 10.7M model on an A100, with the test split reported).

The one command, on a machine with one CUDA GPU and the data where qkv finds it ($QKV_DATA):

    python benchmarks/gpu_recipes.py --out benchmarks/results/gpu/gpu_recipes_h200.json

For each task, each candidate in :data:`CANDIDATES` (the recipe as shipped, or with a few values
changed) trains for the recipe's whole budget, alone on the GPU, one after another, as ``qkv train
--recipe NAME`` would (``start_run`` + ``run_training``). Each is then scored on validation only, by
``qkv evaluate`` itself: BLEU with the recipe's beam and length penalty (a translation run), nats per
character over the whole split (a language model). The best on validation is chosen; for translation
its length penalty is then chosen on validation among :data:`ALPHAS`. Only then is the chosen run
scored on its test split (test 2016; the text's last 5%), once. Nothing is chosen on a test split.
The JSON is written after every candidate (with ``machine``, ``command``, ``date`` and ``commit``), so
a command cut short keeps what it did. It never edits a recipe: the chosen values are copied into the
recipe files by hand, with the JSON beside them.

Each candidate takes its budget plus its scoring: about 4 x 11.5 minutes for Multi30k and 4 x 5.5 for
the language model, ~70 minutes in all. ``--tasks`` and ``--only`` run part of it; ``--minutes M``
trains each candidate M minutes instead of its budget (a pace check on a GPU lent for less: the JSON
then judges no target, ``met_target`` null). One Multi30k candidate needs ~12 minutes of a GPU.

Smoke test on a CPU (seconds: tiny models, 2 steps, a few sentences; the JSON says ``"smoke": true``,
and its figures mean nothing):

    python benchmarks/gpu_recipes.py --device cpu --smoke --out /tmp/gpu_recipes_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.data.spec import DataSpec
from qkv.models.causal_lm import CausalLMConfig
from qkv.models.transformer import TransformerConfig
from qkv.runs.recipes import load_recipe
from qkv.runs.translation import run_training, start_run
from qkv.runtime.device import pick_device

REPO = Path(__file__).resolve().parent.parent
TASKS = {
    "multi30k": {
        "recipe": "multi30k-gpu",
        "target": "test 2016 sacreBLEU >= 41 within the 10-minute budget on one H100 or H200",
        "chosen_by": "validation sacreBLEU, beam search with the recipe's beam and length penalty (qkv evaluate --split val)",
    },
    "tinyshakespeare": {
        "recipe": "tinyshakespeare-gpu",
        "target": "validation <= 1.47 nats/char within the 5-minute budget (nanoGPT's published figure, A100)",
        "chosen_by": "validation nats/char over the whole split (qkv evaluate --split val)",
    },
}
# each candidate: model and training values over the recipe's ({}: the recipe as shipped)
CANDIDATES: dict[str, dict[str, dict]] = {
    "multi30k": {
        "recipe": {},
        "rdrop3": {"rdrop": 3.0},  # R-Drop: its second pass costs little where steps are overhead-bound
        "d256": {"d_model": 256, "num_heads": 4, "num_encoder_layers": 3, "num_decoder_layers": 3, "d_ff": 1024},
        "layers6": {"num_encoder_layers": 6, "num_decoder_layers": 6},
    },
    "tinyshakespeare": {
        "recipe": {},
        "lr03": {"lr_factor": 0.3},  # peak 1.5e-3 (the recipe's 0.2: nanoGPT's 1e-3)
        "lr04": {"lr_factor": 0.4},  # peak 2.0e-3
        "dropout01": {"dropout": 0.1},
    },
}
ALPHAS = (0.6, 1.0, 1.6, 2.2)  # length penalties tried on validation for the chosen translation run
# --smoke: tiny models and runs, so that the whole path runs on a CPU in seconds
SMOKE_MODEL = {  # max_len bounds how long an untrained model's beam search runs
    "multi30k": {
        "d_model": 32,
        "num_heads": 2,
        "num_encoder_layers": 1,
        "num_decoder_layers": 1,
        "d_ff": 64,
        "max_len": 48,
    },
    "tinyshakespeare": {"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64, "context": 32},
}
SMOKE_TRAIN = {  # the translation run is scored after training only; the language model keeps its best validation
    "multi30k": {"max_steps": 2, "max_tokens": 512, "eval_every_minutes": 0.0, "checkpoint_every_steps": 1},
    "tinyshakespeare": {"max_steps": 2, "max_tokens": 512, "eval_every_steps": 1, "eval_sentences": 4},
}
SMOKE_VOCAB, SMOKE_LIMIT = 300, 5


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="where to train and score (default cuda; cpu for --smoke)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default both)")
    p.add_argument(
        "--only", default=None, help="comma-separated candidate names to train (default: all of each task's)"
    )
    p.add_argument("--data", default=None, help="the Multi30k folder (default: $QKV_DATA/multi30k or qkv's cache)")
    p.add_argument(
        "--text-dir", default=None, help="the folder of tiny Shakespeare's input.txt (default: as qkv finds it)"
    )
    p.add_argument("--run-root", default=str(REPO / "runs" / "gpu-recipes"), help="where the run folders go")
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train each candidate this long instead of its recipe's budget (a pace check: no target is judged)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny models, 2 steps, 5 sentences: a test of the path only")
    add_result_options(p, required=True)
    return p, p.parse_args(argv)


def chosen_candidates(args: argparse.Namespace) -> dict[str, list[str]]:
    """``{task: candidate names}`` for the tasks and candidates the command line asks for."""
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"--tasks: {', '.join(unknown) or 'none'}; choose from {', '.join(TASKS)}")
    only = None if args.only is None else [n for n in args.only.split(",") if n]
    if only is not None:
        known = {name for task in tasks for name in CANDIDATES[task]}
        missing = [n for n in only if n not in known]
        if missing or not only:
            raise ValueError(f"--only: {', '.join(missing) or 'none'}; candidates are {', '.join(sorted(known))}")
    picked = {task: [n for n in CANDIDATES[task] if only is None or n in only] for task in tasks}
    return {task: names for task, names in picked.items() if names}


def split_changes(task: str, changes: dict) -> tuple[dict, dict]:
    """A candidate's values as (model options, training options)."""
    model_class = TransformerConfig if task == "multi30k" else CausalLMConfig
    model_fields = {f.name for f in fields(model_class)}
    return {k: v for k, v in changes.items() if k in model_fields}, {
        k: v for k, v in changes.items() if k not in model_fields
    }


def data_spec(task: str, args: argparse.Namespace) -> DataSpec:
    if task == "multi30k":
        return DataSpec(source="multi30k", folder=args.data, src_lang="en", tgt_lang="de")
    return DataSpec(source="tinyshakespeare", folder=args.text_dir)


def train_candidate(task: str, name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Train one candidate for its recipe's budget; its row (what it changed, steps, seconds, tokens/s)."""
    changes = CANDIDATES[task][name]
    model_options, train_options = split_changes(task, changes)
    if args.smoke:
        model_options = {**SMOKE_MODEL[task], **model_options}
        train_options = {**SMOKE_TRAIN[task], **train_options}
    if args.minutes is not None:
        train_options["max_minutes"] = args.minutes
    train_options = {"seed": 0, "progress": sys.stderr.isatty(), **train_options}
    run_dir = Path(args.run_root) / task / name
    torch.manual_seed(0)
    trainer = start_run(
        run_dir,
        data=data_spec(task, args),
        model_options=model_options,
        train_options=train_options,
        vocab_size=SMOKE_VOCAB if args.smoke and task == "multi30k" else None,
        overwrite=True,
        device=device,
        recipe=TASKS[task]["recipe"],
    )
    started = time.perf_counter()
    run_training(trainer)
    state = trainer.state
    row = {
        "changes": changes,
        "run_dir": str(run_dir),
        "steps": state.step,
        "train_seconds": round(state.seconds, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "tokens": state.tokens,
        "tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "bf16": trainer.config.bf16,
    }
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def evaluate(run_dir: str, split: str, args: argparse.Namespace, device: torch.device, *extra: str) -> dict:
    """``qkv evaluate RUN --split SPLIT --json`` run here, its scores (a language model's one split)."""
    from qkv.cli import main as qkv_main

    argv = ["evaluate", run_dir, "--split", split, "--json", "--device", str(device), *extra]
    if args.smoke:
        argv += ["--limit", str(SMOKE_LIMIT)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = qkv_main(argv)
    if code != 0:
        raise RuntimeError(f"qkv {' '.join(argv)} ended with {code}")
    try:  # a translation run's scores: one object
        scores = json.loads(out.getvalue())
    except json.JSONDecodeError:  # a language model's: one a line, here the one split asked for
        scores = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")][-1]
    return {**scores, "command": f"qkv {' '.join(argv)}"}


def validation_score(task: str, scores: dict) -> float:
    """The figure the choice is made on, larger is better: BLEU, or minus nats/char."""
    return scores["bleu"] if task == "multi30k" else -scores["bits_per_char"] * math.log(2)


def with_nats(scores: dict) -> dict:
    return {**scores, "nats_per_char": scores["bits_per_char"] * math.log(2)} if "bits_per_char" in scores else scores


def run_task(
    task: str, names: list[str], args: argparse.Namespace, device: torch.device, report: dict, out: Path
) -> None:
    """Train and score ``task``'s candidates on validation, choose, then score the chosen one's test split."""
    recipe = load_recipe(TASKS[task]["recipe"])
    entry = report["tasks"][task] = {
        **TASKS[task],
        "recipe_file": recipe.file,
        "budget_minutes": recipe.train.get("max_minutes") if args.minutes is None else args.minutes,
        "minutes_override": args.minutes,
        "candidates": {},
    }
    for name in names:
        row = train_candidate(task, name, args, device)
        entry["candidates"][name] = row
        write_result(out, report)  # the training is kept even if scoring fails
        row["val"] = with_nats(evaluate(row["run_dir"], "val", args, device))
        row["val_score"] = validation_score(task, row["val"])
        write_result(out, report)
    chosen = max(names, key=lambda n: entry["candidates"][n]["val_score"])
    entry["chosen"] = chosen
    run_dir, extra = entry["candidates"][chosen]["run_dir"], []
    if task == "multi30k":
        tried = {str(alpha): evaluate(run_dir, "val", args, device, "--alpha", str(alpha))["bleu"] for alpha in ALPHAS}
        best = max(ALPHAS, key=lambda a: (tried[str(a)], a == recipe.decode.get("alpha")))  # a tie: the recipe's
        entry["alpha"] = {"tried_on_validation_bleu": tried, "chosen": best, "recipe": recipe.decode.get("alpha")}
        extra = ["--alpha", str(best)]
        write_result(out, report)
    test = entry["test"] = with_nats(evaluate(run_dir, "test", args, device, *extra))
    val = entry["candidates"][chosen]["val"]
    if args.minutes is not None:  # not the recipe's budget: its target is not judged
        entry["met_target"] = None
    elif task == "multi30k":
        entry["met_target"] = test["bleu"] >= 41.0 and entry["candidates"][chosen]["train_seconds"] <= 600
    else:
        entry["met_target"] = val["nats_per_char"] <= 1.47 and entry["candidates"][chosen]["train_seconds"] <= 300
    write_result(out, report)
    logging.info(
        "%s: chosen %s on validation; test %s",
        task,
        chosen,
        json.dumps({k: test.get(k) for k in ("bleu", "nats_per_char")}),
    )


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    out = check_result_file(parser, args)
    try:
        picked = chosen_candidates(args)
        device = pick_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report: dict = {
        "what": "the recipes for one GPU: candidates trained for the recipe's whole budget one after another, "
        "chosen on validation only; the chosen one's test split scored once",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "smoke": args.smoke,
        "candidates_asked": picked,
        "tasks": {},
    }
    if args.smoke:
        report["note"] = "--smoke: tiny models for 2 steps, 5 sentences or windows scored; the figures mean nothing"
    for task, names in picked.items():
        run_task(task, names, args, device, report, out)
    print(
        json.dumps(
            {task: {"chosen": e["chosen"], "met_target": e["met_target"]} for task, e in report["tasks"].items()}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
