"""What buys the most BLEU in a fixed time: short Multi30k runs of candidate settings, scored on
the VALIDATION split only (test sets are never used to choose anything).

Each candidate is the library's Multi30k recipe (``qkv.runs.recipes.RECIPES["multi30k"]``) with a few
fields changed; each trains for ``--minutes`` of wall time from scratch (same seed, same data) and is
scored with beam ``--beam`` on the averaged last checkpoints, sacreBLEU on the whole validation split.
The JSON (and a bar chart beside it) lists, per candidate, the changes, the minutes it trained, its
steps, target tokens/s and validation BLEU/chrF. Candidates run one after another: other processes on
the machine change steps per minute and so the BLEU, so run it on an otherwise idle machine and read
the load average recorded with each candidate.

    python benchmarks/recipe_sweep.py --minutes 12                     # every candidate
    python benchmarks/recipe_sweep.py --minutes 12 --only budget,narrow  # some of them
    python benchmarks/recipe_sweep.py --list

Short runs end before the hour's regime shows (on a machine where bf16 is fast, the recipe stops gaining
after about 30 epochs, which a 12-minute run never reaches), so hour-long candidates are trained with
``benchmarks/train_multi30k.py`` (one option changed each) and gathered here, validation only, into one
table and one plot of their validation curves; the first JSON is the reference the others' changes are
named against:

    python benchmarks/recipe_sweep.py --collect benchmarks/results/multi30k/multi30k_en_de_xeon_bf16.json \
        benchmarks/results/multi30k/multi30k_en_de_xeon_bf16_dropout03.json \
        --out benchmarks/results/multi30k/sweeps/recipe_sweep_hour.json

Results are merged into the JSON (``--out``, default benchmarks/results/multi30k/sweeps/recipe_sweep.json) by
candidate name, so candidates can be run in several sessions. Smoke test (seconds):

    python benchmarks/recipe_sweep.py --minutes 0.1 --only baseline --eval-limit 20 --out /tmp/sweep.json \\
        --run-root /tmp/sweep-runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data import resolve_multi30k
from qkv.data.sources import load_split
from qkv.data.spec import DataSpec
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import score_translations
from qkv.runs import folder as ckpt
from qkv.runs.translation import run_training, start_run
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import atomic_path

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "benchmarks" / "results" / "multi30k" / "sweeps"

# name -> (what it tests, TransformerConfig overrides, TrainConfig overrides, joint BPE vocabulary or None)
CANDIDATES: dict[str, tuple[str, dict, dict, int | None]] = {
    "baseline": ("the recipe as it is", {}, {}, None),
    "budget": ("rate decays linearly to zero over the whole budget", {}, {"schedule": "budget"}, None),
    "budget-tail": (
        "rate decays to zero over the last 30% of the budget",
        {},
        {"schedule": "budget", "decay_fraction": 0.3},
        None,
    ),
    "budget-hot": ("budget decay with a 1.5x higher peak rate", {}, {"schedule": "budget", "lr_factor": 1.05}, None),
    "narrow": ("d_ff 512: more steps an hour", {"d_ff": 512}, {}, None),
    "shallow": ("2+2 layers: more steps an hour", {"num_encoder_layers": 2, "num_decoder_layers": 2}, {}, None),
    "dropout-0.2": ("more dropout", {"dropout": 0.2}, {}, None),
    "dropout-0.3": ("the dropout Multi30k papers use", {"dropout": 0.3}, {}, None),
    "batch-6k": ("6,000 padded tokens a batch", {}, {"max_tokens": 6000}, None),
    "vocab-5k": ("a 5,000-token joint BPE", {}, {}, 5000),
    "smoothing-0.2": ("label smoothing 0.2", {}, {"label_smoothing": 0.2}, None),
    "subword-0.1": ("subword dropout 0.1: each sentence cut afresh every epoch", {}, {"subword_dropout": 0.1}, None),
}


def machine(threads: int) -> dict:
    return {**environment(), "threads": threads}


def run_candidate(name: str, args: argparse.Namespace, data: DataSpec, device: str) -> dict:
    """Train one candidate for ``args.minutes`` and score it on the validation split."""
    about, model_options, train_options, vocab = CANDIDATES[name]
    run_dir = Path(args.run_root) / name
    options = {
        "max_minutes": args.minutes,
        "seed": args.seed,
        "progress": sys.stderr.isatty(),
        "eval_every_minutes": max(args.minutes / 4, 0.05),
        "checkpoint_every_minutes": max(args.minutes / 10, 0.01),
        **train_options,
    }
    if args.no_bf16:
        options["bf16"] = False
    torch.manual_seed(args.seed)
    load_start = os.getloadavg()
    trainer = start_run(
        run_dir,
        data=data,
        model_options=model_options,
        train_options=options,
        vocab_size=vocab,
        overwrite=True,
        device=device,
        recipe="multi30k",  # named: on a GPU the data's default would be multi30k-gpu
    )
    start = time.perf_counter()
    run_training(trainer)
    wall = time.perf_counter() - start
    model, tokenizer, _ = ckpt.load_run(run_dir, "model")  # the averaged last checkpoints
    model.to(device)
    val = load_split(data, "val")
    src, refs = val.src, val.tgt
    if args.eval_limit:
        src, refs = src[: args.eval_limit], refs[: args.eval_limit]
    hyps = translate_texts(model, tokenizer, src, beam_size=args.beam, bf16=trainer.config.bf16)
    scores = score_translations(hyps, refs)
    state = trainer.state
    result = {
        "about": about,
        "model_options": model_options,
        "train_options": train_options,
        "vocab_size": vocab,
        "minutes_trained": round(state.seconds / 60, 2),
        "wall_seconds": round(wall, 1),
        "steps": state.step,
        "target_tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        f"val_bleu_beam{args.beam}": scores["bleu"],
        f"val_chrf_beam{args.beam}": scores["chrf"],
        "val_sentences": len(src),
        "bleu_signature": scores.get("signature"),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    logging.info("%s: %d steps, val BLEU %.2f", name, state.step, scores["bleu"])
    return result


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = f"val_bleu_beam{report['beam']}"
    names = [n for n in CANDIDATES if n in report["candidates"]]
    values = [report["candidates"][n][key] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(names) + 1.2))
    ax.barh(names[::-1], values[::-1], color="#4c72b0")
    for i, v in enumerate(values[::-1]):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlabel(f"validation sacreBLEU (beam {report['beam']}) after {report['minutes']:g} minutes")
    ax.set_xlim(min(values) - 2, max(values) + 2)
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def plot_curves(rows: dict, png: Path) -> None:
    """Validation BLEU against minutes, one line per hour-long candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5 + 0.22 * len(rows)))
    for name, r in rows.items():
        points = r["val_bleu_greedy_300_vs_minutes"]
        ax.plot([m for m, _ in points], [b for _, b in points], marker="o", label=f"{name} ({r['steps']:,} steps)")
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("validation sacreBLEU (greedy, 300 sentences)")
    ax.grid(True, alpha=0.3)
    # below the axes: over them, a long list hides the early minutes
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.14), frameon=False)
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _changes(reference: dict, run: dict) -> dict:
    """The model and training fields in which ``run`` differs from ``reference`` (budgets aside)."""
    from dataclasses import MISSING, fields

    from qkv.models.transformer import TransformerConfig
    from qkv.training import TrainConfig

    skip = {"max_minutes", "progress", "seed"}
    # a field newer than the reference's report counts where it differs from its default
    defaults = {
        part: {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        for part, cls in (("model", TransformerConfig), ("train", TrainConfig))
    }
    return {
        f"{part}.{k}": v
        for part in ("model", "train")
        for k, v in run[part].items()
        if k not in skip and reference[part].get(k, defaults[part].get(k)) != v
    }


def collect(paths: list[Path], out: Path) -> dict:
    """Gather hour-long runs of benchmarks/train_multi30k.py into one sweep report (validation only:
    test scores stay in the runs' own JSONs) and plot their validation curves beside it."""
    from qkv.runtime.fileio import read_json

    runs = [(path, read_json(path)) for path in paths]
    reference = runs[0][1]
    rows = {}
    for path, run in runs:
        changes = _changes(reference, run)
        name = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in changes.items()) or "reference"
        if name in rows:  # the same settings again (another seed, machine or date): a row of its own
            name = f"{name} ({path.name})"
        scores = run["scores"]["averaged"]
        beam = run.get("decode", {}).get("beam_size", 5)  # reports older than the decode field used beam 5
        rows[name] = {
            "json": path.name,
            "changes": changes,
            "pair": run["task"],
            "minutes_trained": round(run["train_wall_seconds"] / 60, 1),
            "steps": run["steps"],
            "epochs": run["epochs"],
            "target_tokens_per_s": run["target_tokens_per_s"],
            "parameters": run["parameters"],
            f"val_bleu_beam{beam}": scores[f"val_beam{beam}"]["bleu"],
            f"val_bleu_beam{beam}_papers_form": scores[f"val_beam{beam}"]["bleu_papers_form"]["bleu"],
            "val_bleu_greedy_300_vs_minutes": [
                [round(c["minutes"], 1), c["val_bleu_greedy_300"]] for c in run["bleu_vs_minutes"]
            ],
            "val_loss_vs_minutes": [[round(c["minutes"], 1), c["val_loss"]] for c in run["bleu_vs_minutes"]],
            "beam": beam,
            "machine": {
                k: run["machine"].get(k)
                for k in ("cpu_model", "cpu_family", "avx512_bf16", "amx", "threads", "loadavg_end")
            },
            "bf16": run["train"]["bf16"],
        }
    report = {
        "task": "Multi30k recipe sweep of hour-long runs, validation only (the first is the reference)",
        "command": " ".join(["python"] + sys.argv),
        "candidates": rows,
    }
    write_result(out, report)
    plot_curves(rows, out.with_suffix(".png"))
    for name, r in rows.items():
        bleu = r[f"val_bleu_beam{r['beam']}"]
        print(f"{r['minutes_trained']:5.1f} min {r['steps']:6d} steps  val beam {r['beam']}: {bleu:6.2f}  {name}")
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--minutes", type=float, default=12.0, help="training wall time of each candidate")
    p.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    p.add_argument("--list", action="store_true", help="list the candidates and exit")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N validation pairs (smoke tests)")
    p.add_argument("--no-bf16", action="store_true", help="float32 even where bf16 is fast")
    p.add_argument("--run-root", default=str(REPO / "runs" / "sweep"), help="one run folder per candidate under it")
    add_result_options(
        p,
        what="the sweep's JSON (default benchmarks/results/multi30k/sweeps/recipe_sweep.json, "
        "with --collect recipe_sweep_hour.json: never the trained sweep's file by accident); a "
        "sweep adds its candidates to an existing one, and training a candidate it already holds "
        "needs --overwrite",
    )
    p.add_argument(
        "--collect",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="gather benchmarks/train_multi30k.py reports into one table and plot instead of training",
    )
    args = p.parse_args()
    if args.collect:
        out = check_result_file(p, args, args.out or SWEEPS / "recipe_sweep_hour.json")
        try:
            collect(args.collect, out)
        except (OSError, ValueError, KeyError) as e:  # a missing file, not JSON, not a train_multi30k.py report
            p.error(f"--collect: {type(e).__name__}: {e}")
        return 0
    args.out = args.out or str(SWEEPS / "recipe_sweep.json")
    if args.list:
        for name, (about, model, train, vocab) in CANDIDATES.items():
            print(f"{name:14s} {about}  model={model} train={train} vocab={vocab}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidates {unknown}; --list shows them")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    device = str(pick_device())  # CUDA where there is one, else the CPU
    try:  # --data, $QKV_DATA/multi30k or the cache (downloaded there if missing, as qkv train does)
        folder = resolve_multi30k(args.data).resolve()
    except FileNotFoundError as err:
        p.error(str(err))
    data = DataSpec(source="multi30k", folder=str(folder), src_lang=args.src, tgt_lang=args.tgt)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    if report and (report.get("minutes"), report.get("beam"), report.get("pair")) != (
        args.minutes,
        args.beam,
        f"{args.src}-{args.tgt}",
    ):
        p.error(
            f"{out} holds a sweep with other settings (minutes {report.get('minutes')}, beam "
            f"{report.get('beam')}, {report.get('pair')}); pass another --out"
        )
    again = [name for name in names if name in report.get("candidates", {})]
    if again and not args.overwrite:
        p.error(f"{out} already holds {', '.join(again)}: pass --overwrite to train them again, or another --out")
    report.update(
        task="Multi30k recipe sweep, scored on the validation split only",
        pair=f"{args.src}-{args.tgt}",
        minutes=args.minutes,
        beam=args.beam,
        machine=machine(args.threads),
        command=" ".join(["python"] + sys.argv),
    )
    report.setdefault("candidates", {})
    for name in names:
        report["candidates"][name] = run_candidate(name, args, data, device)
        write_result(out, report)  # after every candidate: a crash loses at most the one running
    plot(report, out.with_suffix(".png"))
    key = f"val_bleu_beam{args.beam}"
    for name, r in sorted(report["candidates"].items(), key=lambda kv: -kv[1][key]):
        print(f"{name:14s} {r[key]:6.2f}  {r['steps']:5d} steps  {r['minutes_trained']:6.2f} min  {r['about']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
