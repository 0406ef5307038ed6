"""Trainer.step now against Trainer.step at an earlier commit, side by side in one run.

The training step of ``qkv bench training`` (:func:`qkv.bench.training.make_train_step`: one
:meth:`~qkv.training.Trainer.step` per batch) on the Multi30k recipe's model (d_model 256, 3+3
layers, joint BPE 8000), float32, on the benchmark's Multi30k batches. Each side runs in a process of
its own with its own source tree on ``PYTHONPATH`` (today's: this checkout's ``src``; before:
``--before-src``, e.g. a ``git worktree add /tmp/before COMMIT``), at each --threads count; the sides
take turns, the order swapped each round. A worker builds the model from seed 0, takes --warmup steps
untimed, then times --steps steps (perf_counter each); a side's figure is the median over every timed
step of its rounds, and the two sides' losses are compared (the same code path must give the same
steps). On a loaded machine whole steps vary more than the change could cost, so each worker also
times the only code of the step the hooks changed (finding the step's objective and entering its
context), ``dispatch_s``, to set against the step's time.

    python benchmarks/studies/trainer_refactor_before_after.py --before-src /tmp/before/src \\
        --out benchmarks/results/performance/trainer_refactor_zen5.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(args: argparse.Namespace) -> None:
    """One side at one thread count: time ``args.steps`` training steps; print a JSON line."""
    import torch

    torch.set_num_threads(args.threads[0])
    from qkv.bench.data import multi30k_data
    from qkv.bench.training import make_train_step, multi30k_config
    from qkv.models.transformer import Transformer

    data = multi30k_data(args.data, max_tokens=args.max_tokens, num_batches=args.warmup + args.steps)
    torch.manual_seed(0)
    model = Transformer(multi30k_config(data))
    losses: list[float] = []
    from qkv.training import Trainer

    real_step = Trainer.step

    def step(self, batches):  # the loss of each step, to check both sides train the same
        stats = real_step(self, batches)
        losses.append(stats.loss)
        return stats

    Trainer.step = step
    train_step = make_train_step(model, data, device=torch.device("cpu"), bf16=False, d_model=256)
    for _ in range(args.warmup):
        train_step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    tokens = [b.num_tgt_tokens for b in data.batches][args.warmup : args.warmup + args.steps]
    print(json.dumps({"times": times, "tokens": tokens, "losses": losses, "dispatch_s": _dispatch(model)}))


def _dispatch(model) -> float:
    """Median seconds of what a step does to find its objective and its context (entered and left):
    the only code of the step that the hooks changed; before them ``step_objective`` and late dropout."""
    import timeit

    from qkv.bench.training import _ContenderTask
    from qkv.training import TrainConfig, Trainer

    trainer = Trainer(model, _ContenderTask(model, 0), TrainConfig(progress=False), d_model=256)
    if hasattr(trainer, "hooks"):

        def once() -> None:
            trainer.hooks.objective(trainer.objective, trainer.progress)
            with trainer.hooks.around_step(trainer, 1):
                pass
    else:
        from qkv.training.objectives import step_objective

        def once() -> None:
            step_objective(trainer.config, trainer.progress)
            with trainer.late_dropout.step(trainer.model, trainer.progress, 1, log=True):
                pass

    return statistics.median(timeit.repeat(once, number=2000, repeat=7)) / 2000


def run_side(src: Path, threads: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", "--threads", str(threads), "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens)]
    command += ["--data", str(args.data)] if args.data else []
    if args.cpus:
        command = ["taskset", "-c", args.cpus, *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({src}, {threads} threads):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from qkv.bench.provenance import provenance
    from qkv.bench.results import add_result_options, check_result_file
    from qkv.runtime.fileio import write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-src", type=Path, help="the earlier commit's src folder (a git worktree's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes at each thread count")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per turn")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--max-tokens", type=int, default=6000, help="padded tokens per batch (the benchmark's)")
    parser.add_argument("--data", default=None, help="the Multi30k folder (default: qkv's lookup)")
    parser.add_argument("--cpus", default=None, help="taskset CPU list for the workers, e.g. 0-1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_result_options(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.before_src is None:
        parser.error("--before-src is required")
    out = check_result_file(parser, args)
    sides = {"before": args.before_src.resolve(), "now": ROOT / "src"}
    figures: dict = {}
    for threads in args.threads:
        turns: dict[str, list[dict]] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                turns[name].append(run_side(sides[name], threads, args))
                print(f"{threads} threads, round {r + 1}, {name}: {turns[name][-1]['times']}", file=sys.stderr)
        medians = {name: statistics.median(t for turn in turns[name] for t in turn["times"]) for name in sides}
        tokens = sum(turns["now"][0]["tokens"])
        figures[f"{threads}_threads"] = {
            "median_step_s": medians,
            "tokens_per_s": {name: tokens / args.steps / m for name, m in medians.items()},
            "now_over_before_step_time": medians["now"] / medians["before"],
            "round_medians_s": {name: [statistics.median(t["times"]) for t in turns[name]] for name in sides},
            "dispatch_s": {name: statistics.median(t["dispatch_s"] for t in turns[name]) for name in sides},
            "same_losses": all(a["losses"] == b["losses"] for a, b in zip(turns["before"], turns["now"], strict=True)),
        }
        print(json.dumps({threads: figures[f"{threads}_threads"]["now_over_before_step_time"]}), file=sys.stderr)
    base = subprocess.run(
        ["git", "-C", str(args.before_src), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    found = provenance()
    report = {
        "benchmark": "trainer_refactor_before_after",
        "question": "does the Trainer's step with its checkpoints object and step hooks cost what the mixin's did?",
        **found,  # its commit: the checkout timed as "now"
        "before_commit": base or "unknown",
        "model": "Multi30k recipe: d_model 256, 4 heads, 3+3 layers, d_ff 1024, joint BPE 8000, float32",
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "before_src", "out")},
        "load_average_at_end": list(os.getloadavg()),
        "results": figures,
    }
    write_json(out, report)
    print(json.dumps({k: v["now_over_before_step_time"] for k, v in figures.items()}))


if __name__ == "__main__":
    main()
