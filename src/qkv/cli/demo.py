"""``qkv demo``: train a small Transformer on the built-in date task in about two minutes.

    qkv demo                      # writes qkv-out/demo/: run folder, heatmaps, explorer, summary.json

It generates dates in 18 surface forms ("Tuesday, 3 March 1998", "3/3/98", "the third of March,
1998", ...), trains until held-out exact match reaches 99.5% (or the time cap), prints the accuracy
on 2,000 fresh held-out dates and some translations, and writes the cross-attention of a few
examples as PNG heatmaps plus a self-contained HTML attention explorer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SAMPLE_FORMATS = ["Tuesday, 3 March 1998", "3/3/98", "the third of March, 1998", "March 3rd, 1998", "3.3.1998",
                  "03-Mar-1998", "TUESDAY, MARCH 3, 1998", "19980303"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="qkv-out/demo", help="output folder (default qkv-out/demo)")
    parser.add_argument("--minutes", type=float, default=2.5, help="cap on training time (default 2.5)")
    parser.add_argument("--target", type=float, default=0.998,
                        help="stop once held-out exact match reaches this (default 0.998)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: the model is tiny, and extra threads only wait on each other "
                             "when other programs share the CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def sample_sources(seed: int) -> list[str]:
    """A few held-out dates written in different surface forms."""
    from qkv.data.dates import format_date, generate_dates

    dates = generate_dates(len(SAMPLE_FORMATS), seed=seed + 3, split="test").tgt
    return [format_date(dt.date.fromisoformat(d), fmt) for d, fmt in zip(dates, SAMPLE_FORMATS)]


def run(args: argparse.Namespace) -> int:
    from qkv.data.sources import load_split
    from qkv.device import pick_device
    from qkv.evaluation import exact_match, translate_texts
    from qkv.fileio import write_json
    from qkv.runs import run_training, start_run
    from qkv.viz import Seq2SeqExplorer, explorer_data, save_heatmaps, write_html

    start = time.perf_counter()
    device = pick_device(args.device)  # before the output folder is made
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"source": "dates", "train_size": 20000, "valid_size": 1000, "seed": args.seed}
    options = {"max_minutes": args.minutes, "stop_at_exact_match": args.target, "seed": args.seed,
               "progress": not args.no_progress and sys.stderr.isatty()}
    trainer = start_run(out / "run", data=data, train_options=options, overwrite=True, device=device)
    print(f"training a {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.1f}M-parameter Transformer on "
          f"{trainer.task.num_examples:,} generated dates (held-out dates are never trained on)", file=sys.stderr)
    run_training(trainer)
    model, tokenizer = trainer.model.eval(), trainer.task.tokenizer
    train_seconds = trainer.state.seconds

    test = load_split(data, "test")
    hyps = translate_texts(model, tokenizer, test.src)
    accuracy = exact_match(hyps, test.tgt)
    print(f"\nexact match on {len(test):,} held-out dates: {100 * accuracy:.2f}% "
          f"({trainer.state.step} steps, {train_seconds:.0f} s of training)\n")
    samples = sample_sources(args.seed)
    for src, hyp in zip(samples, translate_texts(model, tokenizer, samples)):
        print(f"  {src:<36} -> {hyp}")
    errors = [(s, h, r) for s, h, r in zip(test.src, hyps, test.tgt) if h != r]
    if errors:
        print(f"\n{len(errors)} held-out errors, e.g.:")
        for s, h, r in errors[:5]:
            print(f"  {s:<36} -> {h} (expected {r})")

    explorer = Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="qkv demo: dates")
    examples = [explorer.example(text) for text in samples[:4]]
    html = write_html(explorer_data(examples, title="qkv demo: date normalisation"), out / "attention.html")
    for example in examples:  # heatmaps of the cross-attention only: the alignment source -> ISO date
        example["views"] = [v for v in example["views"] if v["name"] == "cross-attention"]
    pngs = save_heatmaps(explorer_data(examples, title="cross-attention"), out / "heatmaps")
    summary = {
        "exact_match": round(accuracy, 4), "test_dates": len(test), "steps": trainer.state.step,
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.perf_counter() - start, 1),
        "stopped_early": trainer.state.stopped_early, "threads": torch.get_num_threads(), "device": str(device),
        "samples": dict(zip(samples, translate_texts(model, tokenizer, samples))),
    }
    write_json(out / "summary.json", summary)
    print(f"\nwrote {len(pngs)} cross-attention heatmaps to {out / 'heatmaps'}, the explorer {html}, "
          f"the run folder {out / 'run'} and {out / 'summary.json'}")
    print(json.dumps({k: summary[k] for k in ("exact_match", "steps", "train_seconds", "total_seconds")}),
          file=sys.stderr)
    return 0
