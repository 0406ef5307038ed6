"""Which of today's parts help qkv's character language model at a fixed budget? Validation only.

Each variant is the tinyshakespeare recipe with a few [model] / [train] values changed (written as a
recipe file in --work-dir), trained with the plain ``qkv train --data tinyshakespeare --recipe FILE
--minutes M --seed S`` and scored on the whole validation split with ``qkv evaluate RUN --split val``
(nats per character). The test split is never read: this study chooses, it does not report a test
figure. Runs go one at a time (``--cpus`` pins them, e.g. to one core while something else runs on
the other), so a variant's budget buys the steps that its own speed gives it. ``--collect`` scores
finished runs without training.

    python benchmarks/lm_parts_study.py --minutes 5 --seeds 0 --work-dir WORK --cpus 1 \\
        --out benchmarks/results/language-model/lm_parts_5min_zen5_1core.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "src" / "qkv" / "runs" / "recipes" / "tinyshakespeare.toml"
# each variant: the lines added to the recipe's [model] and [train] tables
VARIANTS: dict[str, dict[str, list[str]]] = {
    "gpt2": {"model": [], "train": []},  # the recipe as it is: learned positions, LayerNorm, GELU, biases
    "llama": {"model": ['norm = "rms"', 'positional = "rotary"', 'activation = "swiglu"', "bias = false"], "train": []},
    "llama_muon": {
        "model": ['norm = "rms"', 'positional = "rotary"', 'activation = "swiglu"', "bias = false"],
        "train": ['optimizer = "muon"'],
    },
    "relu2_qk_norm": {
        "model": ['norm = "rms"', 'positional = "rotary"', 'activation = "relu2"', "qk_norm = true", "bias = false"],
        "train": [],
    },
}


def recipe_text(name: str) -> str:
    """The tinyshakespeare recipe with ``name``'s lines added, as a recipe file of its own."""
    text = RECIPE.read_text(encoding="utf-8")
    text = re.sub(r"^(default_for|gpu_variant) = .*$\n", "", text, flags=re.MULTILINE)  # a copy, not a default
    lines = text.splitlines()
    for table in ("model", "train"):
        at = lines.index(next(line for line in lines if line.startswith(f"[{table}]"))) + 1
        lines[at:at] = VARIANTS[name][table]
    return "\n".join(lines) + "\n"


def _run(command: list[str], cpus: str | None) -> str:
    prefix = ["taskset", "-c", cpus] if cpus else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if cpus else ""))
    done = subprocess.run(prefix + command, capture_output=True, text=True, env=env, check=True)
    return done.stdout + done.stderr


def score(run_dir: Path, cpus: str | None) -> dict:
    """The run's whole validation split, as ``qkv evaluate --split val`` reports it, and its steps."""
    out = _run([sys.executable, "-m", "qkv", "evaluate", str(run_dir), "--split", "val"], cpus)
    loss = re.search(r"loss ([0-9.]+) nats/token", out)
    if loss is None:
        raise RuntimeError(f"{run_dir}: no validation loss in qkv evaluate's output:\n{out[-500:]}")
    state = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = max((row.get("step", 0) for row in state), default=0)
    config = json.loads((run_dir / "config.json").read_text())
    return {"val_nats_per_char": float(loss.group(1)), "steps": steps, "model": config["model"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--work-dir", type=Path, required=True, help="recipe files and run folders go here")
    parser.add_argument("--cpus", default=None, help="taskset CPU list for the runs, e.g. 1")
    parser.add_argument(
        "--collect", action="store_true", help="score the finished runs in --work-dir only (the --seeds that exist)"
    )
    add_result_options(parser)
    args = parser.parse_args()
    if args.out:
        check_result_file(parser, args)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for name in args.variants:
        recipe = args.work_dir / f"{name}.toml"
        recipe.write_text(recipe_text(name), encoding="utf-8")
        runs = []
        for seed in args.seeds:
            run_dir = args.work_dir / f"{name}_seed{seed}_{args.minutes:g}min"
            train = ["qkv", "train", "--data", "tinyshakespeare", "--recipe", str(recipe)]
            train += ["--minutes", f"{args.minutes:g}", "--seed", str(seed), "--run-dir", str(run_dir)]
            if args.collect and not run_dir.is_dir():
                continue  # --collect: the runs that exist (a variant run with fewer seeds)
            if not args.collect:
                _run([sys.executable, "-m", "qkv", *train[1:], "--overwrite"], args.cpus)
            runs.append({"seed": seed, "train_command": " ".join(train), **score(run_dir, args.cpus)})
            print(f"{name} seed {seed}: val {runs[-1]['val_nats_per_char']:.4f} in {runs[-1]['steps']} steps")
        values = [r["val_nats_per_char"] for r in runs]
        results[name] = {
            "recipe_lines": VARIANTS[name],
            "runs": runs,
            "val_mean": statistics.mean(values),
            "val_spread": statistics.pstdev(values) if len(values) > 1 else None,
        }
    base = results.get("gpt2")
    report = {
        "question": "which of today's parts help the character LM at a fixed budget (validation only)",
        "minutes": args.minutes,
        "cpus": args.cpus,
        "variants": results,
        "against_gpt2_layout": {
            name: round(r["val_mean"] - base["val_mean"], 4) for name, r in results.items() if base is not None
        },
    }
    if args.out:
        write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
