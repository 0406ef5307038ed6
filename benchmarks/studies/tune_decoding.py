"""Tune decoding on the validation split only: weights (averaged / last / best), beam size and
length penalty alpha for a finished Multi30k run, then score test 2016 once with the setting
that won on validation (test is never used to choose).

    python benchmarks/studies/tune_decoding.py --run-dir runs/m30k-en-de-budget-1555 \\
        --out benchmarks/results/multi30k/multi30k_en_de_decoding.json

Beam search ranks finished hypotheses by ``log p / ((5 + len) / 6) ** alpha`` (qkv.decoding.search);
short output (a BLEU brevity penalty below 1) is what a larger alpha counters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.sources import load_split
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import score_translations
from qkv.runs.folder import load_run, read_run_config
from qkv.training.checkpoint_files import average_weight_files
from qkv.training.checkpoint_files import load_weights as load_weight_file


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def load_weights(run_dir: Path, weights: str, scratch: Path):
    """The run's model with ``weights``: model / last / best as qkv evaluate loads them, or
    ``avgK``, the average of the last K checkpoints in ``run_dir/checkpoints``."""
    if not weights.startswith("avg"):
        return load_run(run_dir, weights)[:2]
    k = int(weights[3:])
    kept = sorted((run_dir / "checkpoints").glob("step_*.safetensors"), key=lambda f: int(f.stem.split("_")[1]))
    if len(kept) < k:
        raise SystemExit(f"{run_dir}: {len(kept)} checkpoints kept, {weights} needs {k}")
    average_weight_files(kept[-k:], scratch)
    model, tokenizer, _ = load_run(run_dir, "last")
    load_weight_file(model, scratch)
    return model, tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument(
        "--weights",
        default="model,last",
        help="comma-separated: model (the run's average), last, best, ema (--ema-decay), or avgK (the "
        "last K checkpoints the run kept, averaged here)",
    )
    p.add_argument("--beams", type=ints, default=[4, 5, 8])
    p.add_argument("--alphas", type=floats, default=[0.6, 1.0, 1.4, 2.0])
    p.add_argument("--threads", type=int, default=None)
    add_result_options(p, required=True)
    args = p.parse_args()
    check_result_file(p, args)  # before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    spec = read_run_config(run_dir)["data"]
    tgt = spec.get("tgt_lang")
    val, test = load_split(spec, "val"), load_split(spec, "test")
    rows = []
    scratch = Path(tempfile.mkdtemp()) / "average.safetensors"
    for weights in args.weights.split(","):
        model, tokenizer = load_weights(run_dir, weights, scratch)
        for beam, alpha in itertools.product(args.beams, args.alphas):
            start = time.perf_counter()
            hyps = translate_texts(model, tokenizer, val.src, beam_size=beam, alpha=alpha)
            scores = score_translations(hyps, val.tgt, target_lang=tgt)
            rows.append(
                {
                    "weights": weights,
                    "beam": beam,
                    "alpha": alpha,
                    "val_bleu": scores["bleu"],
                    "val_bleu_papers_form": scores["bleu_papers_form"]["bleu"],
                    "val_details": scores["bleu_details"],
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    best = max(rows, key=lambda r: r["val_bleu"])
    model, tokenizer = load_weights(run_dir, best["weights"], scratch)
    hyps = translate_texts(model, tokenizer, test.src, beam_size=best["beam"], alpha=best["alpha"])
    test_scores = score_translations(hyps, test.tgt, target_lang=tgt)
    report = {
        "command": " ".join(["python"] + sys.argv),
        "run_dir": str(run_dir),
        "chosen_on": "val",
        "grid": rows,
        "chosen": {k: best[k] for k in ("weights", "beam", "alpha", "val_bleu")},
        "test_2016": test_scores,
        "machine": environment(),
    }
    write_result(args.out, report)
    print(
        json.dumps(
            {
                "chosen": report["chosen"],
                "test_2016_bleu": test_scores["bleu"],
                "test_2016_papers_form": test_scores["bleu_papers_form"]["bleu"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
