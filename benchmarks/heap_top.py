"""What keeping freed memory at the top of glibc's heaps (qkv.runtime.heap.keep_heap_top) buys a training step.

glibc gives the top of a heap back to the OS on a ``free`` that leaves more than its trim threshold
free there; a training step frees ~100 MB of activations at once, so the next step page-faults them in
again. The setting is process-wide, so each variant runs in its own fresh process: the Multi30k
recipe's step (``qkv.training.Trainer.step`` on real 2,000-token batches, as benchmarks/cpu_step_paths.py
builds it) with qkv's start-up settings (``qkv.runtime.heap.limit_memory_growth``) with and without the heap
top kept, alternated A, B, A, B, ... so that a host whose speed drifts touches both alike. Reports
target tokens/s, minor page faults a step, and the ratio of each round's pair.

    python benchmarks/heap_top.py --rounds 3 --out benchmarks/results/performance/heap_top_steps.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"heap top kept": True, "glibc's default": False}


def child(args: argparse.Namespace) -> dict:
    from qkv.runtime.heap import limit_memory_growth

    applied = limit_memory_growth(heap_trim_threshold=None) if not args.keep else limit_memory_growth()
    import cpu_step_paths
    import torch

    from qkv.training import TrainConfig

    torch.set_num_threads(args.threads)
    bf16 = args.precision == "bf16"
    data, config = cpu_step_paths.recipe_data_and_model(args.data, bf16, batches=30)
    step = cpu_step_paths.make_step(
        data, config, TrainConfig(bf16=bf16, label_smoothing=0.1, progress=False), frozenset()
    )
    for _ in range(args.warmup):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    tokens = sum(step() for _ in range(args.steps))
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {
        "settings": applied,
        "steps": args.steps,
        "tokens_per_s": round(tokens / seconds, 1),
        "minor_page_faults_per_step": round(faults / args.steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache)")
    parser.add_argument(
        "--precisions", default="auto", help="comma list of bf16, float32; auto: bf16 where fast, and float32"
    )
    parser.add_argument("--rounds", type=int, default=3, help="pairs of processes per precision")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "performance" / "heap_top_steps.json"),
        help="the result JSON; an existing file is kept unless --overwrite",
    )
    # declared by hand, not by qkv.bench.results.add_result_options: importing qkv.bench imports torch, which a
    # child must not do before its start-up memory settings (limit_memory_growth)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    from qkv.bench.provenance import write_result
    from qkv.bench.results import check_result_file
    from qkv.bench.timing import environment
    from qkv.runtime.precision import bf16_is_fast

    for name, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    names = (
        args.precisions.split(",")
        if args.precisions != "auto"
        else (["bf16", "float32"] if bf16_is_fast("cpu") else ["float32"])
    )
    unknown = [name for name in names if name not in ("bf16", "float32")]
    if unknown:
        parser.error(f"unknown precision {unknown[0]!r}: use bf16, float32 or auto")
    if args.data is not None and not Path(args.data).is_dir():
        parser.error(f"--data {args.data}: no such folder (Multi30k's task-1 files)")
    out = check_result_file(parser, args)
    from qkv.data import resolve_multi30k

    try:  # the children get the folder found: --data, $QKV_DATA/multi30k or the cache
        args.data = str(resolve_multi30k(args.data, download=False))
    except FileNotFoundError as err:
        parser.error(str(err))
    results = {}
    for precision in names:
        rounds = []
        for r in range(args.rounds):
            pair = {}
            for name, keep in VARIANTS.items() if r % 2 == 0 else reversed(VARIANTS.items()):
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    "--precision",
                    precision,
                    "--data",
                    args.data,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--threads",
                    str(args.threads),
                ]
                done = subprocess.run(cmd + (["--keep"] if keep else []), capture_output=True, text=True)
                if done.returncode:
                    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"error: the {precision} process ({name}) failed: {last}", file=sys.stderr)
                    return 1
                pair[name] = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"{precision} round {r + 1} {name:16s} {pair[name]['tokens_per_s']:8.1f} tokens/s  "
                    f"{pair[name]['minor_page_faults_per_step']:7d} faults/step",
                    flush=True,
                )
            pair["kept_over_default"] = round(
                pair["heap top kept"]["tokens_per_s"] / pair["glibc's default"]["tokens_per_s"], 3
            )
            rounds.append(pair)
        results[precision] = {
            "rounds": rounds,
            "median_kept_over_default": statistics.median(p["kept_over_default"] for p in rounds),
        }
        print(
            f"{precision}: heap top kept / glibc's default, median of {args.rounds} rounds: "
            f"{results[precision]['median_kept_over_default']}x"
        )
    write_result(
        out,
        {
            "what": __doc__.split("\n\n")[0],
            "command": " ".join(["python"] + sys.argv),
            "results": results,
            "machine": environment(),
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
