"""Finished language-model runs scored as lm_vs_nanogpt.py scores them, grouped by recipe: over seeds, a mean and a spread.

lm_vs_nanogpt.py trains each tool once. This scores finished qkv runs of tiny Shakespeare: every
character of the whole validation and test splits, non-overlapping windows of ``--context``
characters (nanoGPT's 64 in the comparison) plus one last window, with each run's
``model.safetensors`` (its best validation's weights). Runs whose configurations agree except in
``--seed`` (the initial weights and the batch order) form a group, reported with the mean and the
spread (sample standard deviation) of each split: how far apart runs of one command land, which a
one-seed comparison cannot say. Each group records how its configuration differs from the first
group's (another dropout, say), so a change is read against the spread of seeds.

    qkv train --data tinyshakespeare --minutes 30 --seed 1 --run-dir /tmp/lm-seed1
    QKV_DATA=/work/shared/data python benchmarks/lm_score.py --run /tmp/lm-seed0 --run /tmp/lm-seed1 \\
        --out benchmarks/results/language-model/lm_seeds_30min_MACHINE.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_vs_nanogpt  # noqa: E402  (a sibling script: its scorer)

from qkv.bench.provenance import write_result  # noqa: E402
from qkv.bench.results import add_result_options, check_result_file  # noqa: E402
from qkv.bench.timing import environment  # noqa: E402
from qkv.data.text import read_text_splits  # noqa: E402
from qkv.models.causal_lm import CausalLM  # noqa: E402
from qkv.runs.curves import read_metrics  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402
from qkv.runtime.fileio import read_json  # noqa: E402

PER_RUN = ("seed",)  # train values that may differ within a group


def describe(run_dir: Path, config: dict) -> dict:
    """What the run trained (``config``: its config.json): its seed, steps, minutes, size (and the
    rule's reason), best validation."""
    records = read_metrics(run_dir / "metrics.jsonl")
    valid = [r for r in records if r.get("event") == "valid"]
    best = min(valid, key=lambda r: r["val_loss"]) if valid else None
    last = max(records, key=lambda r: r.get("step", 0)) if records else {}
    return {
        "run_dir": str(run_dir),
        "seed": config["train"].get("seed"),
        "minutes_budget": config["train"].get("minutes"),
        "steps": last.get("step"),
        "minutes_at_last_record": last.get("minutes"),
        "model": {k: config["model"][k] for k in ("d_model", "num_layers", "num_heads", "d_ff", "context", "dropout")},
        "sizing": config.get("recipe", {}).get("sizing", {}).get("why"),
        "best_validation": None if best is None else {"step": best["step"], "minutes": best.get("minutes")},
    }


def recipe_of(config: dict) -> dict:
    """A run's configuration without what varies between runs of one recipe (the seed)."""
    train = {k: v for k, v in config["train"].items() if k not in PER_RUN}
    return {**config, "train": train}


def differences(a: dict, b: dict, prefix: str = "") -> dict:
    """``{dotted key: [a's value, b's value]}`` where two configurations differ."""
    out: dict = {}
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out.update(differences(x, y, f"{prefix}{key}."))
        elif x != y:
            out[f"{prefix}{key}"] = [x, y]
    return out


def summarize(values: list[float]) -> dict:
    return {
        "mean": round(statistics.mean(values), 4),
        "sample_std": round(statistics.stdev(values), 4) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "runs": len(values),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, action="append", required=True, help="a finished run (repeat the option)")
    p.add_argument("--context", type=int, default=64, help="the scoring windows (default 64, nanoGPT's)")
    add_result_options(p, required=True)
    args = p.parse_args(argv)
    out = check_result_file(p, args)
    for run_dir in args.run:
        if not (run_dir / "config.json").is_file():
            p.error(f"{run_dir}: not a run folder (config.json missing)")
    configs = [read_json(r / "config.json") for r in args.run]
    texts = read_text_splits({"source": "tinyshakespeare", "folder": None})
    splits = {"val": texts.val, "test": texts.test}
    runs = []
    for run_dir, config in zip(args.run, configs):
        try:
            model, tokenizer, _ = load_run(run_dir, "model", task="lm")
        except ValueError as err:
            p.error(str(err))  # names the run folder
        if not isinstance(model, CausalLM):
            p.error(f"{run_dir}: not a language-model run")
        record = describe(run_dir, config)
        record["scores"] = {}
        for name, text in splits.items():
            assert text is not None
            ids = tokenizer.encode(text)
            if len(ids) != len(text):  # the figures are nats per character
                p.error(f"{run_dir}: not a character-level run; this script scores character models")
            record["scores"][name] = lm_vs_nanogpt.score(model, ids, min(args.context, model.config.context))
        runs.append(record)
        print(f"{run_dir} (seed {record['seed']}): " + ", ".join(
            f"{n} {s['nats_per_char']:.4f}" for n, s in record["scores"].items()))  # fmt: skip
    groups: list[dict] = []
    for config, record in zip(configs, runs):
        recipe = recipe_of(config)
        group = next((g for g in groups if g["recipe"] == recipe), None)
        if group is None:
            group = {"recipe": recipe, "runs": []}
            groups.append(group)
        group["runs"].append(record)
    summary: list[dict] = []
    for group in groups:
        summary.append({
            "differs_from_first_group": differences(groups[0]["recipe"], group["recipe"]),
            "seeds": [r["seed"] for r in group["runs"]],
            "run_dirs": [r["run_dir"] for r in group["runs"]],
            **{name: summarize([r["scores"][name]["nats_per_char"] for r in group["runs"]]) for name in splits},
        })  # fmt: skip
    report = {
        "what": "qkv's language-model runs scored as benchmarks/lm_vs_nanogpt.py scores (nats/char over every "
        "character of the whole split, windows of the context), grouped by recipe: seeds' mean and spread",
        "machine": {**environment(), "threads": torch.get_num_threads()},
        "context": args.context,
        "runs": runs,
        "summary": summary,
    }
    write_result(out, report, ["benchmarks/lm_score.py", *(sys.argv[1:] if argv is None else argv)])
    for group in summary:
        what = group["differs_from_first_group"] or "the first group"
        for name in splits:
            g = group[name]
            spread = "" if g["sample_std"] is None else f", sample std {g['sample_std']:.4f}"
            print(f"{what}: {name} mean {g['mean']:.4f}{spread} over {g['runs']} run(s)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
