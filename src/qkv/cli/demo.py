"""``qkv demo``: train a small Transformer on the built-in date task in about two minutes.

    qkv demo                      # writes qkv-out/demo/: run folder, heatmaps, explorer, summary.json

It generates dates in 18 surface forms ("Tuesday, 3 March 1998", "3/3/98", "the third of March,
1998", ...), trains until held-out exact match reaches 99.8% (or the time cap), prints the accuracy
on 2,000 fresh held-out dates and some translations, and writes the cross-attention of a few
examples as PNG heatmaps plus a self-contained HTML attention explorer.

The output folder is marked as the demo's (a ``.qkv-demo`` file), so running the demo again
replaces its own earlier output; a folder the demo did not make (a run folder from ``qkv train``,
a folder holding other files, a file) is refused before any training, touching nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import time
from pathlib import Path
from typing import cast

import torch

logger = logging.getLogger(__name__)

DEMO_MARKER = ".qkv-demo"  # the file that marks an output folder as the demo's own
DEMO_OUTPUTS = ("run", "heatmaps", "attention.html", "summary.json")  # what the demo writes in it
SUMMARY_KEYS = {"exact_match", "test_dates", "steps", "samples"}  # in every summary.json the demo wrote

SAMPLE_FORMATS = [
    "Tuesday, 3 March 1998",
    "3/3/98",
    "the third of March, 1998",
    "March 3rd, 1998",
    "3.3.1998",
    "03-Mar-1998",
    "TUESDAY, MARCH 3, 1998",
    "19980303",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv demo``'s flags: ``--out``, the time cap ``--minutes``, the exact-match
    ``--target`` to stop at, ``--seed``, ``--threads``, ``--device`` and ``--no-progress``.

    Args:
        parser: the ``demo`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("--out", default="qkv-out/demo", help="output folder (default qkv-out/demo)")
    parser.add_argument("--minutes", type=float, default=2.5, help="cap on training time (default 2.5)")
    parser.add_argument(
        "--target", type=float, default=0.998, help="stop once held-out exact match reaches this (default 0.998)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: the model is tiny, and extra threads only wait on each other "
        "when other programs share the CPU)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _made_by_an_earlier_demo(out: Path) -> bool:
    """An output folder of the demo from before the marker existed: nothing but the demo's outputs
    (and the temporaries of an interrupted write), with a summary.json only the demo writes."""
    names = {p.name for p in out.iterdir()}
    leftovers = {n for n in names if n.startswith(".") and (n.endswith(".tmp") or n.startswith(".run."))}
    if "summary.json" not in names or not names - leftovers <= set(DEMO_OUTPUTS):
        return False
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and set(summary) >= SUMMARY_KEYS


def is_demo_folder(out: str | Path) -> bool:
    """True when ``out`` is a folder an earlier ``qkv demo`` made (marked, or from before the mark)."""
    out = Path(out)
    if not out.is_dir():
        return False
    return (out / DEMO_MARKER).is_file() or _made_by_an_earlier_demo(out)


def check_output_folder(out: str | Path) -> None:
    """Check, before any work, that the demo may write into ``out``: it does not exist yet, is an
    empty folder, or is a folder an earlier demo made (whose ``run/`` must then be the demo's: a qkv
    run on the date task, or empty). Anything else (a file, a run folder from ``qkv train``, a folder
    holding other files) raises ``ValueError`` in one line; nothing is written or deleted."""
    from qkv.runs.folder import is_run_folder, read_run_config

    out = Path(out)
    refuse = "qkv demo writes only into a new or empty folder or its own earlier output: choose another --out"
    if out.is_symlink() and not out.exists():
        raise ValueError(f"{out}: a broken link; {refuse}")
    if not out.exists():
        for parent in out.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise NotADirectoryError(f"{out}: lies under {parent}, which is a file; {refuse}")
                break
        return
    if not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder; {refuse}")
    if not any(out.iterdir()):
        return
    if is_run_folder(out):
        raise ValueError(f"{out}: a qkv run folder, not a demo's output folder; {refuse}")
    if not is_demo_folder(out):
        raise ValueError(f"{out}: holds files qkv demo did not make (no {DEMO_MARKER} file); {refuse}")
    run_dir = out / "run"  # replaced by the new run: only a run the demo itself could have made
    replace = "qkv demo would replace it: move it or choose another --out"
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        raise ValueError(f"{run_dir}: not a folder; {replace}")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not is_run_folder(run_dir):
            raise ValueError(f"{run_dir}: not a qkv run folder and not empty; {replace}")
        data = read_run_config(run_dir).get("data")
        source = data.get("source") if isinstance(data, dict) else None
        if source != "dates":
            raise ValueError(
                f"{run_dir}: a qkv run trained on {source!r}, not the demo's run on the date task; {replace}"
            )
    cwd = Path.cwd().resolve()
    if run_dir.exists() and (cwd == run_dir.resolve() or run_dir.resolve() in cwd.parents):
        raise ValueError(f"{run_dir}: holds the current directory; qkv demo will not replace it")
    if (out / "heatmaps").is_symlink() or ((out / "heatmaps").exists() and not (out / "heatmaps").is_dir()):
        raise ValueError(f"{out / 'heatmaps'}: not a folder of its own; qkv demo writes its heatmaps there")
    for name in ("attention.html", "summary.json"):
        if (out / name).is_dir():
            raise IsADirectoryError(f"{out / name}: is a folder; qkv demo writes this file")


def mark_output_folder(out: str | Path) -> None:
    """Make ``out`` (if needed) and mark it as the demo's, so a later demo may replace what it holds."""
    from qkv.runtime.fileio import write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / DEMO_MARKER).is_file():
        write_text(
            out / DEMO_MARKER,
            "made by qkv demo: a later qkv demo --out here replaces run/, heatmaps/*.png, "
            "attention.html and summary.json\n",
        )


def sample_sources(seed: int) -> list[str]:
    """A few held-out dates written in different surface forms."""
    from qkv.data.dates import format_date, generate_dates

    dates = generate_dates(len(SAMPLE_FORMATS), seed=seed + 3, split="test").tgt
    return [format_date(dt.date.fromisoformat(d), fmt) for d, fmt in zip(dates, SAMPLE_FORMATS)]


def _print_examples(samples: list[str], outputs: list[str], srcs: list[str], hyps: list[str], refs: list[str]) -> None:
    """The sample dates' rewrites, then up to five held-out errors."""
    for src, hyp in zip(samples, outputs):
        print(f"  {src:<36} -> {hyp}")
    errors = [(s, h, r) for s, h, r in zip(srcs, hyps, refs) if h != r]
    if errors:
        print(f"\n{len(errors)} held-out errors, e.g.:")
        for s, h, r in errors[:5]:
            print(f"  {s:<36} -> {h} (expected {r})")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv demo``: check ``--out`` (see :func:`check_output_folder`), train a Transformer on
    generated dates until the exact-match target or the time cap, print the held-out accuracy and
    some rewrites, and write the run folder, cross-attention heatmaps, the HTML explorer and
    ``summary.json`` into ``--out``.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once everything is written. An output folder the demo may not write into
        raises before any training, which the CLI reports as exit code 2.
    """
    from qkv.data.sources import load_split
    from qkv.data.spec import DataSpec
    from qkv.decoding.translate import translate_texts
    from qkv.metrics.scores import exact_match
    from qkv.models.transformer import Transformer
    from qkv.runs.translation import run_training, start_run
    from qkv.runtime.device import pick_device
    from qkv.runtime.fileio import write_json
    from qkv.viz import Seq2SeqExplorer, explorer_data, save_heatmaps, write_html

    start = time.perf_counter()
    out = Path(args.out)
    check_output_folder(out)  # before anything is read, trained or written
    device = pick_device(args.device)  # before the output folder is made
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    mark_output_folder(out)
    data = DataSpec(source="dates", train_size=20000, valid_size=1000, seed=args.seed)
    options = {
        "max_minutes": args.minutes,
        "stop_at_exact_match": args.target,
        "seed": args.seed,
        "progress": not args.no_progress and sys.stderr.isatty(),
    }
    trainer = start_run(out / "run", data=data, train_options=options, overwrite=True, device=device)
    print(
        f"training a {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.1f}M-parameter Transformer on "
        f"{trainer.task.num_examples:,} generated dates (held-out dates are never trained on)",
        file=sys.stderr,
    )
    run_training(trainer)
    # start_run trains a Transformer on the dates (the Trainer holds it as a plain nn.Module)
    model, tokenizer = cast(Transformer, trainer.model.eval()), trainer.task.tokenizer
    train_seconds = trainer.state.seconds

    test = load_split(data, "test")
    hyps = translate_texts(model, tokenizer, test.src)
    accuracy = exact_match(hyps, test.tgt)
    print(
        f"\nexact match on {len(test):,} held-out dates: {100 * accuracy:.2f}% "
        f"({trainer.state.step} step{'' if trainer.state.step == 1 else 's'}, {train_seconds:.0f} s of training, "
        f"{trainer.stopped_by()})\n"
    )
    samples = sample_sources(args.seed)
    _print_examples(samples, translate_texts(model, tokenizer, samples), test.src, hyps, test.tgt)

    explorer = Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="qkv demo: dates")
    examples = [explorer.example(text) for text in samples[:4]]
    html = write_html(explorer_data(examples, title="qkv demo: date normalisation"), out / "attention.html")
    for example in examples:  # heatmaps of the cross-attention only: the alignment source -> ISO date
        example["views"] = [v for v in example["views"] if v["name"] == "cross-attention"]
    pngs = save_heatmaps(explorer_data(examples, title="cross-attention"), out / "heatmaps")
    summary = {
        "exact_match": round(accuracy, 4),
        "test_dates": len(test),
        "steps": trainer.state.step,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "stopped_early": trainer.state.stopped_early,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "samples": dict(zip(samples, translate_texts(model, tokenizer, samples))),
    }
    write_json(out / "summary.json", summary)
    print(
        f"\nwrote {len(pngs)} cross-attention heatmaps to {out / 'heatmaps'}, the explorer {html}, "
        f"the run folder {out / 'run'} and {out / 'summary.json'}"
    )
    print(
        json.dumps({k: summary[k] for k in ("exact_match", "steps", "train_seconds", "total_seconds")}), file=sys.stderr
    )
    print(f"\nopen {html} in a browser: the attention of every head, offline")
    return 0
