"""Candidates for the hour's Multi30k recipe compared at the steps the hour gives them, many at once.

On a 2-core CPU each hour-long candidate costs an hour. What a candidate reaches in the hour is set
by the optimizer steps it makes there, so the same comparison can run where there is more compute (a
GPU): each candidate trains for the steps a CPU hour gives it (``--steps``, the recipe's steps in the
hour on the CPU in question, divided by the candidate's cost per step relative to the recipe's, as
measured on that CPU: ``COST`` below), with the same budget schedule brought to zero over those steps
instead of the minutes, a checkpoint at each twentieth of them (the hour's every 3 minutes) and the
last 2 averaged, as the hour does. All candidates train side by side, one process and one CPU thread
each, and are scored with beam 5 and the recipe's length penalty on the validation split (which is
what chooses) and on test 2016 (reported; nothing is chosen on it).

The accelerator's bf16 rounds differently from a CPU's, so absolute scores differ a little from the
hour's; use the table to rank candidates, then confirm the winner with a real hour
(``benchmarks/train_multi30k.py --minutes 60``).

    python benchmarks/step_matched_sweep.py --steps 11000 --only recipe,recipe_seed1,lr07 \\
        --run-root /tmp/sweep --out benchmarks/results/multi30k/sweeps/step_matched_sweep.json
    python benchmarks/step_matched_sweep.py --fit-seconds 360 ...   # --steps as large as fits 360 s
    python benchmarks/step_matched_sweep.py --list

``--fit-seconds`` first trains as many copies of the recipe as there are candidates side by side
for ``--calibrate-steps`` steps, reads their pace from the later half of those steps (the first ones
are slow), and sets ``--steps`` (at most the given one) so that every candidate trains in that many
seconds: a candidate's steps are the recipe's over its cost per step, and a step costs it about as
much more on the accelerator as on the CPU, so all take about as long. On an H200 (one process per
candidate, one CPU thread each) one process alone made ~29 steps/s, 6 side by side ~16 each (~95
together) and 10 side by side ~14 each (~140 together): the recipe's 11,000 steps of a fast 2-core
CPU's hour take one candidate ~6.5 minutes there, and 6 candidates ~11.5; 8 side by side made ~15 each
(6,500 steps in 7.1 minutes), and in float32 with the ~4k-token batches the float32 recipe had then ~10
each (1,900 steps in 3.1 minutes). Start-up and decoding add about 1.2 minutes to a sweep. Runs are written
under ``--run-root`` (``runs/<candidate>``, with ``<candidate>.json`` and ``.log`` beside each; each
run folder keeps its validation and test 2016 translations, ``val.hyp.<tgt>`` and
``test_2016.hyp.<tgt>``, for ``benchmarks/significance.py``). Smoke test (CPU, a minute):

    python benchmarks/step_matched_sweep.py --steps 40 --only recipe,lr07 --eval-limit 20 \\
        --run-root /tmp/sweep-smoke --out /tmp/sweep-smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.spec import DataSpec
from qkv.runs import folder as ckpt
from qkv.runs.recipes import decode_settings
from qkv.runs.translation import run_training, start_run
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import write_json
from qkv.runtime.heap import limit_memory_growth

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_multi30k import REPO, evaluation_splits, score_splits  # noqa: E402  (a sibling script)

# name: (options changed from the recipe, cost of a step relative to the recipe's on the CPU). Only
# candidates whose cost is known are here: the changes below leave the products' shapes alone (1.0),
# and an R-Drop step runs the batch twice (~2x: 10,848 steps in the hour with R-Drop over its last 30%
# against 13,265 without, benchmarks/results/multi30k/multi30k_en_de_epyc_zen5_bf16_*). A candidate that changes
# the model's shape needs its cost measured on the CPU first.
CANDIDATES: dict[str, tuple[dict, float]] = {
    "recipe": ({}, 1.0),
    "recipe_seed1": ({"seed": 1}, 1.0),
    "recipe_seed2": ({"seed": 2}, 1.0),
    "lr07": ({"lr_factor": 0.7}, 1.0),
    "lr035": ({"lr_factor": 0.35}, 1.0),
    "decay06": ({"decay_fraction": 0.6}, 1.0),
    "decay10": ({"decay_fraction": 1.0}, 1.0),
    "dropout025": ({"dropout": 0.25}, 1.0),
    "dropout015": ({"dropout": 0.15}, 1.0),
    "gelu": ({"activation": "gelu"}, 1.0),
    "warmup1600": ({"warmup_steps": 1600}, 1.0),
    "smoothing005": ({"label_smoothing": 0.05}, 1.0),
    "ema": ({"ema_decay": 0.9995, "final_weights": "ema"}, 1.0),
    "average4": ({"average_last": 4}, 1.0),
    "gelu_lr07": ({"activation": "gelu", "lr_factor": 0.7}, 1.0),
    "wd01": ({"weight_decay": 0.1}, 1.0),
    "wd01_seed1": ({"weight_decay": 0.1, "seed": 1}, 1.0),
    "wd03": ({"weight_decay": 0.3}, 1.0),
    # weight decay in place of part of the dropout (the fast-bf16 recipe's is 0.2)
    "wd03_dropout01": ({"weight_decay": 0.3, "dropout": 0.1}, 1.0),
    # the rate brought linearly to zero over all steps after the warmup, or over the last 60%, with weight
    # decay (AdamW's decay acts through the rate, so the schedule sets how much of it each stretch gets)
    "wd01_decay10": ({"weight_decay": 0.1, "decay_fraction": 1.0}, 1.0),
    "wd01_decay06": ({"weight_decay": 0.1, "decay_fraction": 0.6}, 1.0),
    # the float32 recipe (an AVX2-only CPU's: GELU, dropout 0.1, ~2k-token batches, warmup 800 x 0.7), for the
    # ~3,900 steps such a 2-core machine makes in the hour (--steps 3900); the recipe before it (~4k-token
    # batches, warmup 400) costs about twice as much a step
    "fp32": ({"bf16": False}, 1.0),
    "fp32_seed1": ({"bf16": False, "seed": 1}, 1.0),
    "fp32_relu": ({"bf16": False, "activation": "relu"}, 1.0),
    "fp32_relu_seed1": ({"bf16": False, "activation": "relu", "seed": 1}, 1.0),
    "fp32_lr10": ({"bf16": False, "lr_factor": 1.0}, 1.0),
    "fp32_lr05": ({"bf16": False, "lr_factor": 0.5}, 1.0),
    "fp32_wd01": ({"bf16": False, "weight_decay": 0.1}, 1.0),
    "fp32_4k": ({"bf16": False, "max_tokens": 4000, "warmup_steps": 400}, 2.0),
    # R-Drop (twice the cost a step) over the hour's last 30%: 0.7 + 0.3 / 2 = 0.85 of the recipe's steps,
    # starting at 0.7 / 0.85 of them
    "rdrop_late": ({"rdrop": 3.0, "rdrop_start": 0.82}, 1 / 0.85),
}
MODEL_FIELDS = {
    "d_model",
    "num_heads",
    "num_encoder_layers",
    "num_decoder_layers",
    "d_ff",
    "dropout",
    "attention_dropout",
    "activation",
    "norm_first",
}


def candidate_steps(name: str, recipe_steps: int) -> int:
    return max(1, round(recipe_steps / CANDIDATES[name][1]))


def train_one(name: str, args: argparse.Namespace, steps: int, device: str) -> dict:
    """Train one candidate for ``steps`` and score it: a dict for the table."""
    changes, cost = CANDIDATES[name]
    run_dir = Path(args.run_root) / (args.label or name)
    seed = changes.get("seed", args.seed)
    torch.manual_seed(seed)
    model_options = {k: v for k, v in changes.items() if k in MODEL_FIELDS}
    train_options = {k: v for k, v in changes.items() if k not in MODEL_FIELDS}
    every = max(1, steps // 20)  # the hour keeps a checkpoint every 3 of its 60 minutes
    train_options = {
        "max_minutes": 0.0,
        "max_steps": steps,
        "checkpoint_every_minutes": 0.0,
        "checkpoint_every_steps": every,
        "eval_every_minutes": 0.0,
        "eval_every_steps": 0,
        "log_every_steps": max(1, min(50, steps // 8)),
        "progress": False,
        **train_options,
        "seed": seed,
    }
    data = DataSpec(source="multi30k", folder=str(Path(args.data).resolve()), src_lang=args.src, tgt_lang=args.tgt)
    trainer = start_run(  # the CPU's recipe, named: on a GPU the data's default would be multi30k-gpu
        run_dir,
        data=data,
        model_options=model_options,
        train_options=train_options,
        overwrite=True,
        device=device,
        recipe="multi30k",
    )
    t0 = time.perf_counter()
    run_training(trainer)
    train_seconds = time.perf_counter() - t0
    row = {
        "changes": changes,
        "cost_per_step": cost,
        "steps": trainer.state.step,
        "train_seconds": round(train_seconds, 1),
        "epochs": round(trainer.state.epoch, 2),
    }
    if args.calibrating:  # the pace once started: the later half of the logged steps (the first ones are slow)
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logged = [r for r in records if r["event"] == "train"]
        first, last = logged[len(logged) // 2], logged[-1]
        row["steps_per_second"] = round((last["step"] - first["step"]) / ((last["minutes"] - first["minutes"]) * 60), 2)
        return row
    # the row so far, in case the sweep is cut while decoding (the finished row replaces it)
    write_json(Path(args.out), {**row, "scored": False})
    splits, _ = evaluation_splits(data)
    splits = {k: splits[k] for k in ("val", "test_2016")}
    config = ckpt.read_run_config(run_dir)
    decode = decode_settings(config)
    model, tokenizer, _ = ckpt.load_run(run_dir, "model")
    model.to(device)
    scores = score_splits(
        model,
        tokenizer,
        splits,
        beams=(decode["beam_size"],),
        alpha=decode["alpha"],
        bf16=trainer.config.bf16,
        tgt=args.tgt,
        limit=args.eval_limit,
        hyp_dir=run_dir,
    )
    beam = decode["beam_size"]
    row.update(
        {
            "val_bleu": scores[f"val_beam{beam}"]["bleu"],
            "val_chrf": scores[f"val_beam{beam}"]["chrf"],
            "val_bleu_papers_form": scores[f"val_beam{beam}"]["bleu_papers_form"]["bleu"],
            "test_2016_bleu": scores[f"test_2016_beam{beam}"]["bleu"],
            "test_2016_bleu_papers_form": scores[f"test_2016_beam{beam}"]["bleu_papers_form"]["bleu"],
            "decode": decode,
            "model": config["model"],
            "train": config["train"],
        }
    )
    return row


def run_side_by_side(
    jobs: dict[str, str], args: argparse.Namespace, recipe_steps: int, folder: Path, *, calibrate: bool = False
) -> dict:
    """Train ``jobs`` (label: candidate name) side by side, each in its own process (this script
    with --one), their run folders and rows (JSON and log) under ``folder``; the rows by label."""
    folder.mkdir(parents=True, exist_ok=True)
    procs = {}
    with contextlib.ExitStack() as logs:  # each process's log stays open until it has ended
        for label, name in jobs.items():
            cmd = [
                sys.executable,
                __file__,
                "--one",
                name,
                "--label",
                label,
                "--steps",
                str(recipe_steps),
                "--data",
                args.data,
                "--src",
                args.src,
                "--tgt",
                args.tgt,
                "--seed",
                str(args.seed),
                "--eval-limit",
                str(args.eval_limit),
                "--run-root",
                str(folder),
                "--out",
                str(folder / f"{label}.json"),
            ]
            log = logs.enter_context(open(folder / f"{label}.log", "w"))
            procs[label] = subprocess.Popen(
                cmd + (["--calibrating"] if calibrate else []), stdout=log, stderr=subprocess.STDOUT
            )
        rows = {}
        for label, proc in procs.items():
            proc.wait()
            path = folder / f"{label}.json"
            if proc.returncode == 0 and path.is_file():
                rows[label] = json.loads(path.read_text())
            else:  # with what it wrote before it stopped (its training's row, if it got that far)
                rows[label] = {
                    **(json.loads(path.read_text()) if path.is_file() else {}),
                    "failed": f"exit status {proc.returncode}; see {folder / (label + '.log')}",
                }
    return rows


def steps_that_fit(steps_per_second: float, fit_seconds: float, most: int) -> int:
    """The recipe's steps that train in ``fit_seconds`` at the given pace, at most ``most`` (whole
    hundreds from a thousand on). Every candidate takes about as long: its steps are the recipe's over
    its cost per step, and a step costs it about as much more on the accelerator as on the CPU."""
    fit = steps_per_second * fit_seconds
    return min(most, int(fit // 100 * 100) if fit >= 1000 else int(fit))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps",
        type=int,
        default=11000,
        help="the recipe's optimizer steps in the CPU hour being matched (default 11000: an AVX512-BF16 "
        "2-core machine's hour, 10,800-13,300 in benchmarks/results/multi30k)",
    )
    p.add_argument(
        "--fit-seconds",
        type=float,
        default=0.0,
        help="measure first, then lower --steps so that every candidate trains within this many seconds",
    )
    p.add_argument(
        "--calibrate-steps",
        type=int,
        default=400,
        help="steps of each candidate's calibration run (the pace is read from the later half)",
    )
    p.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    p.add_argument("--list", action="store_true", help="list the candidates and exit")
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N val/test pairs (smoke tests)")
    p.add_argument("--run-root", default=str(REPO / "runs" / "step-matched"), help="one run folder per candidate")
    add_result_options(p, REPO / "benchmarks" / "results" / "multi30k" / "sweeps" / "step_matched_sweep.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: train and score this candidate
    p.add_argument("--label", default=None, help=argparse.SUPPRESS)  # the worker's run folder's name
    p.add_argument("--calibrating", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.list:
        for name, (changes, cost) in CANDIDATES.items():
            print(f"{name:20s} cost {cost:.2f}  {changes}")
        return 0
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidates: {', '.join(unknown)} (see --list)")
    if args.steps < 1 or args.calibrate_steps < 1 or args.fit_seconds < 0:
        p.error("--steps and --calibrate-steps must be positive, --fit-seconds not negative")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = str(pick_device())  # CUDA where there is one, else the CPU
    if args.one:  # a worker process
        torch.set_num_threads(1)
        limit_memory_growth()
        steps = args.calibrate_steps if args.calibrating else candidate_steps(args.one, args.steps)
        write_json(Path(args.out), train_one(args.one, args, steps, device))
        return 0

    root = Path(args.run_root)
    taken = [str(root / f) for f in ("runs", "calibration") if (root / f).exists()]
    if taken:  # never train over an earlier sweep's runs
        p.error(f"{', '.join(taken)} exist (an earlier sweep's runs): give another --run-root or remove them")
    check_result_file(p, args)
    from qkv.data import resolve_multi30k

    try:  # the workers get the folder found: --data, $QKV_DATA/multi30k or the cache (as qkv train)
        args.data = str(resolve_multi30k(args.data).resolve())
    except FileNotFoundError as err:
        p.error(str(err))
    t0 = time.perf_counter()
    recipe_steps, calibration = args.steps, None
    if args.fit_seconds:  # as many copies of the recipe as candidates, side by side: the pace of each
        calibration = run_side_by_side(
            {f"recipe_copy{i}": "recipe" for i in range(len(names))},
            args,
            args.calibrate_steps,
            root / "calibration",
            calibrate=True,
        )
        rates = [r["steps_per_second"] for r in calibration.values() if "steps_per_second" in r]
        if not rates:
            raise SystemExit(f"every calibration run failed: {calibration}")
        recipe_steps = steps_that_fit(min(rates), args.fit_seconds, args.steps)
        if recipe_steps < args.calibrate_steps:
            raise SystemExit(
                f"only {recipe_steps} steps fit in --fit-seconds {args.fit_seconds:g} with {len(names)} "
                f"candidates side by side ({min(rates)} steps/s each): give more seconds or fewer "
                "candidates"
            )
        logging.info(
            "calibration: %.1f steps/s each, %d side by side; the recipe's steps set to %d",
            min(rates),
            len(names),
            recipe_steps,
        )
    rows = run_side_by_side({name: name for name in names}, args, recipe_steps, root / "runs")
    report = {
        "what": "Multi30k candidates trained side by side for the steps a CPU hour gives each (the recipe's "
        "steps divided by the candidate's relative cost per step), scored with beam 5 on validation "
        "(chooses) and test 2016 (reported only)",
        "command": " ".join(["python"] + sys.argv),
        "pair": f"{args.src}->{args.tgt}",
        "recipe_steps": recipe_steps,
        "recipe_steps_asked": args.steps,
        "calibration": calibration,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "machine": {**environment(), "device": device, "processes": len(names)},
    }
    write_result(Path(args.out), report)
    print(f"{'candidate':20s} {'steps':>6s} {'val':>6s} {'test16':>6s}")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1].get("val_bleu", -1)):
        print(
            f"{name:20s} {r.get('steps', '-'):>6} {r.get('val_bleu', '-'):>6} {r.get('test_2016_bleu', '-'):>6}"
            + (f"  {r['failed']}" if "failed" in r else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
