"""Which of today's parts help qkv's character language model at a fixed budget? Validation only.

Each variant is the tinyshakespeare recipe with a few [model] / [train] values changed (written as a
recipe file in --work-dir), trained with the plain ``qkv train --data tinyshakespeare --recipe FILE
--minutes M --seed S`` and scored on the whole validation split with ``qkv evaluate RUN --split val``
(nats per character). The test split is never read: this study chooses, it does not report a test
figure. Runs go one at a time (``--cpus`` pins them, e.g. to one core while something else runs on
the other), so a variant's budget buys the steps that its own speed gives it. ``--collect`` scores
finished runs without training.

``--held-out-play`` asks how a variant does on a play it never saw. The validation split continues
The Taming of the Shrew, which the training split holds the first acts of; the test split is half
The Tempest, which it does not hold at all (288 of its 463 speeches are by speakers the training
split never names). A recipe chosen on validation alone can buy memory of the Shrew's names and
lines, which the Tempest does not reward. So this mode trains on the training split without Romeo
and Juliet (133k of its 1.0M characters, one whole play) and scores each run on that play (the run's
own validation text, which also picks its best weights) and on the validation split as before.
Still no test text is read.

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
# each variant spells out its layout and optimizer, so that it stays what its name says whatever the
# recipe's own values are (the recipe is the Llama layout with Muon since 2.0; it was the GPT-2 one)
GPT2 = ['norm = "layer"', 'positional = "learned"', 'activation = "gelu_tanh"', "bias = true"]
LLAMA = ['norm = "rms"', 'positional = "rotary"', 'activation = "swiglu"', "bias = false"]
RELU2_QK_NORM = ['norm = "rms"', 'positional = "rotary"', 'activation = "relu2"', "qk_norm = true", "bias = false"]
ADAMW, MUON = ['optimizer = "adamw"'], ['optimizer = "muon"']
# each variant: the lines that replace (or join) the recipe's [model] and [train] values; "budget": the
# recipe's tokens_per_parameter replaced (another size for the same budget)
VARIANTS: dict[str, dict[str, list[str]]] = {
    "gpt2": {"model": GPT2, "train": ADAMW},  # 1.x's layout: learned positions, LayerNorm, GELU, biases
    "llama": {"model": LLAMA, "train": ADAMW},
    "llama_muon": {"model": LLAMA, "train": MUON},  # the recipe since 2.0
    "relu2_qk_norm": {"model": RELU2_QK_NORM, "train": ADAMW},
    "relu2_qk_norm_muon": {"model": RELU2_QK_NORM, "train": MUON},
    "llama_muon_8tpp": {"model": LLAMA, "train": MUON, "budget": ["tokens_per_parameter = 8.0"]},
    "llama_muon_32tpp": {"model": LLAMA, "train": MUON, "budget": ["tokens_per_parameter = 32.0"]},
    "llama_muon_lr04": {"model": LLAMA, "train": [*MUON, "muon_lr = 0.04"]},
    "llama_muon_dropout": {"model": [*LLAMA, "dropout = 0.1"], "train": MUON},
}
PLAY = ("\n\nSAMPSON:\n", "Than this of Juliet and her Romeo.\n")  # Romeo and Juliet's first and last lines


def recipe_text(name: str) -> str:
    """The tinyshakespeare recipe with ``name``'s lines, as a recipe file of its own: a line whose key
    the recipe has replaces that line, any other goes first in its table."""
    text = RECIPE.read_text(encoding="utf-8")
    text = re.sub(r"^(default_for|gpu_variant) = .*$\n", "", text, flags=re.MULTILINE)  # a copy, not a default
    lines = text.splitlines()
    for table in ("model", "train", "budget"):
        for line in VARIANTS[name].get(table, []):
            key = line.split("=")[0].strip()
            old = [i for i, have in enumerate(lines) if have.startswith(f"{key} =")]
            if old:
                lines[old[0]] = line
            else:
                at = lines.index(next(have for have in lines if have.startswith(f"[{table}]"))) + 1
                lines.insert(at, line)
    return "\n".join(lines) + "\n"


def _run(command: list[str], cpus: str | None) -> str:
    prefix = ["taskset", "-c", cpus] if cpus else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if cpus else ""))
    done = subprocess.run(prefix + command, capture_output=True, text=True, env=env, check=True)
    return done.stdout + done.stderr


def held_out_play_texts(work_dir: Path) -> dict[str, Path]:
    """Text files for ``--held-out-play``: ``train`` (the training split without Romeo and Juliet),
    ``play`` (Romeo and Juliet) and ``val`` (the validation split), written into ``work_dir``."""
    from qkv.data.text import read_text_splits

    texts = read_text_splits({"source": "tinyshakespeare", "folder": None})
    start = texts.train.index(PLAY[0]) + 2
    end = texts.train.index(PLAY[1], start) + len(PLAY[1])
    parts = {"train": texts.train[:start] + texts.train[end:], "play": texts.train[start:end], "val": texts.val}
    paths = {name: work_dir / f"{name}.txt" for name in parts}
    for name, text in parts.items():
        paths[name].write_text(text, encoding="utf-8")
    return paths


def _loss(out: str, run_dir: Path) -> float:
    loss = re.search(r"loss ([0-9.]+) nats/token", out)
    if loss is None:
        raise RuntimeError(f"{run_dir}: no loss in qkv evaluate's output:\n{out[-500:]}")
    return float(loss.group(1))


def score(run_dir: Path, cpus: str | None, texts: dict[str, Path] | None = None) -> dict:
    """The run's whole validation split, as ``qkv evaluate --split val`` reports it, and its steps.
    With ``texts`` (``--held-out-play``), the run's validation text is the held-out play, and the
    validation split is scored too, with ``qkv evaluate --text``."""
    evaluate = [sys.executable, "-m", "qkv", "evaluate", str(run_dir)]
    if texts is None:
        result = {"val_nats_per_char": _loss(_run([*evaluate, "--split", "val"], cpus), run_dir)}
    else:
        result = {
            "held_out_play_nats_per_char": _loss(_run([*evaluate, "--split", "val"], cpus), run_dir),
            "val_nats_per_char": _loss(_run([*evaluate, "--text", str(texts["val"])], cpus), run_dir),
        }
    state = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = max((row.get("step", 0) for row in state), default=0)
    config = json.loads((run_dir / "config.json").read_text())
    return {**result, "steps": steps, "model": config["model"]}


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
    parser.add_argument(
        "--held-out-play",
        action="store_true",
        help="train without Romeo and Juliet and score on it as well (see above)",
    )
    add_result_options(parser)
    args = parser.parse_args()
    if args.out:
        check_result_file(parser, args)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    texts = held_out_play_texts(args.work_dir) if args.held_out_play else None
    data = (
        ["--train-text", str(texts["train"]), "--val-text", str(texts["play"])]
        if texts
        else ["--data", "tinyshakespeare"]
    )
    results: dict[str, dict] = {}
    for name in args.variants:
        recipe = args.work_dir / f"{name}.toml"
        recipe.write_text(recipe_text(name), encoding="utf-8")
        runs = []
        for seed in args.seeds:
            run_dir = args.work_dir / f"{name}_seed{seed}_{args.minutes:g}min"
            train = ["qkv", "train", *data, "--recipe", str(recipe)]
            train += ["--minutes", f"{args.minutes:g}", "--seed", str(seed), "--run-dir", str(run_dir)]
            if args.collect and not run_dir.is_dir():
                continue  # --collect: the runs that exist (a variant run with fewer seeds)
            if not args.collect:
                _run([sys.executable, "-m", "qkv", *train[1:], "--overwrite"], args.cpus)
            runs.append({"seed": seed, "train_command": " ".join(train), **score(run_dir, args.cpus, texts)})
            play = f", held-out play {runs[-1]['held_out_play_nats_per_char']:.4f}" if texts else ""
            print(f"{name} seed {seed}: val {runs[-1]['val_nats_per_char']:.4f}{play} in {runs[-1]['steps']} steps")
        results[name] = {"recipe_lines": VARIANTS[name], "runs": runs}
        for key in ("val", "held_out_play") if texts else ("val",):
            values = [r[f"{key}_nats_per_char"] for r in runs]
            results[name][f"{key}_mean"] = statistics.mean(values)
            results[name][f"{key}_spread"] = statistics.pstdev(values) if len(values) > 1 else None
    base = results.get("gpt2")
    report = {
        "question": "which of today's parts help the character LM at a fixed budget (validation only)",
        "minutes": args.minutes,
        "cpus": args.cpus,
        "held_out_play": "Romeo and Juliet, left out of training" if texts else None,
        "variants": results,
        "against_gpt2_layout": {
            name: round(r["val_mean"] - base["val_mean"], 4) for name, r in results.items() if base is not None
        },
    }
    if texts and base is not None:
        report["held_out_play_against_gpt2_layout"] = {
            name: round(r["held_out_play_mean"] - base["held_out_play_mean"], 4) for name, r in results.items()
        }
    if args.out:
        write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
