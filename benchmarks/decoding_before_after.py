"""qkv's own decoding now against qkv's decoding at an earlier commit, side by side in one run.

Times greedy decoding and beam search (beam 5) of a translation run's test set, the way ``qkv translate``
decodes: the sentences sorted by length and cut into batches of --batch-size (16), about
--timed-sentences of them (240: batches spread evenly from the shortest to the longest) timed. Each
side runs in a process of its own with its own source tree on ``PYTHONPATH`` (today's: this checkout's
``src``; before: ``--before-src``, e.g. a ``git worktree add /tmp/before COMMIT``), at each --threads
count; the two sides take turns, the order swapped each repeat, and a side's time is the median over
--repeats. A worker decodes two batches untimed first, then all the timed batches, timing the pass
(perf_counter). Today's side decodes as ``translate_texts`` does: one
:class:`~qkv.decoding.inference.InferenceModel` built for the pass (its packing is timed with it and
also reported alone); a side without that class decodes the model as that commit did. Whether the two
sides' translations are the same is reported per search.

    python benchmarks/decoding_before_after.py --run /tmp/run --before-src /tmp/before/src \\
        --out benchmarks/results/deploy/inference_object_vs_1x_zen5.json
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SEARCHES = ("greedy", "beam5")
EXTRA_LEN = 50


def _batches(ids: list[list[int]], size: int, sentences: int) -> list[list[int]]:
    """Indices of ``ids`` sorted by length in batches of ``size``; about ``sentences`` of them, spread evenly."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    want = max(1, min(len(batches), -(-sentences // size)))
    step = len(batches) / want
    return [batches[int(i * step)] for i in range(want)]


def worker(args: argparse.Namespace) -> None:
    """One side at one thread count: time one pass of ``args.search``; print a JSON line."""
    import torch

    torch.set_num_threads(args.threads[0])
    import qkv.decoding.search as search
    from qkv.data.batching import pad_sequences
    from qkv.data.sources import load_split
    from qkv.runs.folder import load_run

    try:
        from qkv.decoding.inference import InferenceModel
    except ImportError:  # a commit before the inference object
        InferenceModel = None  # noqa: N806
    model, tok, config = load_run(args.run, "model", task="translation")
    model.eval()
    split = load_split(config.get("data") or {}, "test")
    limit = model.config.max_len - 1
    ids = [s[:limit] + [tok.eos_id] for s in tok.encode_batch(split.src)]
    batches = _batches(ids, args.batch_size, args.timed_sentences)
    pad, bos, eos = model.config.pad_id, tok.bos_id, tok.eos_id

    def decode(decoder: Any, batch: list[int]) -> list[list[int]]:
        src = pad_sequences([ids[i] for i in batch], pad)
        if args.search == "greedy":
            return search.greedy_decode(decoder, src, bos_id=bos, eos_id=eos, extra_len=EXTRA_LEN)
        return search.beam_search(decoder, src, bos_id=bos, eos_id=eos, beam_size=5, extra_len=EXTRA_LEN)

    build = (lambda: InferenceModel.build(model)) if InferenceModel is not None else (lambda: model)
    warm = build()
    for batch in batches[:2]:
        decode(warm, batch)
    start = time.perf_counter()
    decoder = build()
    built = time.perf_counter() - start
    outputs = [decode(decoder, batch) for batch in batches]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for out in outputs for o in out)
    print(json.dumps(dict(seconds=seconds, build_s=built, tokens=tokens, outputs=outputs, qkv=search.__file__)))


def _run_side(args: argparse.Namespace, src: str, search: str, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", "--run", args.run, "--search", search, "--threads", str(threads)]
    command += ["--batch-size", str(args.batch_size), "--timed-sentences", str(args.timed_sentences)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a translation run folder")
    parser.add_argument("--before-src", help="the earlier commit's src folder (a git worktree's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timed-sentences", type=int, default=240)
    parser.add_argument("--search", choices=SEARCHES, default="greedy", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="the result JSON; an existing file is kept unless --overwrite")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.before_src or not args.out:
        parser.error("--before-src and --out are needed")
    from qkv.bench.provenance import write_result
    from qkv.bench.results import check_result_file

    out = check_result_file(parser, args)
    sides = {"before": args.before_src, "now": str(ROOT / "src")}
    report: dict[str, Any] = dict(
        run=str(Path(args.run).resolve()),
        before_src=str(Path(args.before_src).resolve()),
        base_commit=subprocess.run(
            ["git", "-C", args.before_src, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        settings=dict(
            batching=f"length-sorted batches of {args.batch_size} sentences, ~{args.timed_sentences} timed",
            beam=5,
            alpha=0.6,
            repeats=args.repeats,
            timing="a process per side and repeat, sides alternating (order swapped each repeat); median",
        ),
        results={},
    )
    for threads in args.threads:
        for search in SEARCHES:
            runs: dict[str, list[dict]] = {name: [] for name in sides}
            for repeat in range(args.repeats):
                order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
                for name in order:
                    runs[name].append(_run_side(args, sides[name], search, threads))
            median = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
            entry = {
                name: dict(
                    seconds_median=round(median[name], 4),
                    seconds=[round(r["seconds"], 4) for r in rs],
                    build_ms=[round(1000 * r["build_s"], 2) for r in rs],
                    tokens=rs[0]["tokens"],
                )
                for name, rs in runs.items()
            }
            entry["now_over_before"] = round(median["now"] / median["before"], 4)
            entry["same_translations"] = runs["now"][0]["outputs"] == runs["before"][0]["outputs"]
            report["results"][f"{threads}_threads_{search}"] = entry
            print(f"{threads} thread(s) {search}: now/before {entry['now_over_before']}", file=sys.stderr)
    write_result(out, report, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
