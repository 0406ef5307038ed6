"""Resident memory over a long Multi30k training run: does it stay flat after warm-up?

Trains the library's Multi30k recipe (qkv.runs.recipes.RECIPES["multi30k"], En->De) for ``--minutes``
in float32 and, where this machine runs bfloat16 fast (qkv.runtime.precision.bf16_is_fast), in bf16 autocast
too (else the JSON says why it was skipped). Validation and checkpoints are off inside the window,
so nothing but training steps runs. A thread samples the process's resident set size (VmRSS) and its
peak (VmHWM) every ``--interval`` seconds with the step reached. Each (precision, fix) pair trains in
a fresh child process, so one run's memory cannot leak into the next one's figures.

``--fixes`` lists the variants to run, each ``none`` or a ``+``-joined set of measures from
qkv.runtime.heap: ``trim`` returns freed heap memory to the OS every ``--trim-every`` steps
(qkv.runtime.heap.HeapTrimmer), ``onednn`` caps oneDNN's primitive cache at ``--onednn-capacity`` (``onednn=N``:
at N) before the first primitive (qkv.runtime.heap.cap_onednn_primitive_cache; without it oneDNN holds up to
1024), ``pad`` pads the rows of linear layers' bf16 products (qkv.runtime.padded_linear; without it
``qkv.runtime.padded_linear.PAD_ROWS`` is off), ``top`` lets glibc keep freed memory at the top of its heaps for the
next step instead of returning it on every free (qkv.runtime.heap.keep_heap_top), ``mmap`` serves allocations
of ``--mmap-threshold`` bytes or more with mmap (qkv.runtime.heap.mmap_large_allocations); ``fix`` is
``onednn+trim+pad+top``, what training does by default. Process-wide settings are applied first thing,
as the CLI does.

"Flat after warm-up": the largest RSS sample after ``--warmup-minutes`` over the smallest one,
within ``--tolerance`` (10%).

    python benchmarks/memory.py                                  # 20 minutes a run: none, then fix
    python benchmarks/memory.py --fixes none,fix,fix+mmap        # ... and with big blocks mmapped
    python benchmarks/memory.py --minutes 2 --interval 10 --out /tmp/m.json --figure /tmp/m.png  # trial

Writes benchmarks/results/performance/memory.json and docs/figures/memory.png (RSS in MB against minutes, one
line per run: sampled at the end of a step, activations freed, and at the sampling moment itself).
Other processes sharing the CPU slow the steps (the JSON records the load average), not the memory
figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qkv.runtime.heap import HEAP_TRIM_THRESHOLD, ONEDNN_CACHE_CAPACITY

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("trim", "mmap", "onednn", "pad", "top")
COMPOSITES = {"fix": {"onednn", "trim", "pad", "top"}}


# ----------------------------------------------------------------------------- machine
def machine_info(threads: int) -> dict:
    """The machine (qkv.bench.timing.environment, with the bf16 probe's timings), the threads the runs
    use, and the allocator settings in the environment, which change what resident memory does."""
    from qkv.bench.timing import environment

    env = {
        k: os.environ[k]
        for k in (
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
            "MALLOC_ARENA_MAX",
            "MALLOC_TRIM_THRESHOLD_",
            "MALLOC_MMAP_THRESHOLD_",
            "LD_PRELOAD",
        )
        if k in os.environ
    }
    return {**environment(probe_bf16=True), "torch_threads": threads, "env": env}


# ----------------------------------------------------------------------------- one run (child)
def measures_of(fix: str) -> dict[str, int | None]:
    """The measures of a fix and their values: ``"none"`` -> {}; ``"fix+mmap"`` -> onednn, trim, pad
    and mmap, each None (the command line's value); ``"trim+onednn=8"`` -> {"trim": None, "onednn": 8}."""
    if fix == "none":
        return {}
    out: dict[str, int | None] = {}
    for part in fix.split("+"):
        name, _, value = part.partition("=")
        if name in COMPOSITES and not value:
            out.update(dict.fromkeys(COMPOSITES[name]))
        elif name in MEASURES and (not value or value.isdigit()):
            out[name] = int(value) if value else None
        else:
            raise ValueError(
                f"unknown fix {fix!r}: use none, or +-joined {MEASURES + tuple(COMPOSITES)} (onednn=N for a cache of N)"
            )
    return out


def child(args: argparse.Namespace) -> int:
    measures = measures_of(args.fix)
    from qkv.runtime.heap import limit_memory_growth

    capacity = measures.get("onednn") or args.onednn_capacity
    applied = limit_memory_growth(
        onednn_cache_capacity=capacity if "onednn" in measures else None,
        heap_trim_threshold=HEAP_TRIM_THRESHOLD if "top" in measures else None,
        mmap_threshold=args.mmap_threshold if "mmap" in measures else None,
    )
    import torch

    import qkv.runtime.padded_linear

    qkv.runtime.padded_linear.PAD_ROWS = "pad" in measures

    from qkv.data.spec import DataSpec
    from qkv.runs.translation import start_run
    from qkv.runtime.heap import HeapTrimmer, heap_stats, peak_resident_memory_bytes, resident_memory_bytes

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_before = resident_memory_bytes()
    data = DataSpec(source="multi30k", folder=str(Path(args.data).resolve()), src_lang="en", tgt_lang="de")
    train_options = dict(
        max_minutes=args.minutes,
        bf16=args.precision == "bf16",
        eval_every_minutes=0.0,
        eval_every_steps=0,
        checkpoint_every_minutes=0.0,
        checkpoint_every_steps=0,
        average_last=1,
        progress=False,
        log_every_steps=50,
    )
    with tempfile.TemporaryDirectory(prefix="qkv-memory-") as tmp:
        trainer = start_run(  # the CPU recipe on the CPU, also where CUDA is present (this measures host memory)
            Path(tmp) / "run", data=data, train_options=train_options, overwrite=True, recipe="multi30k", device="cpu"
        )
        if trainer.config.bf16 != (args.precision == "bf16"):
            raise SystemExit(f"asked for {args.precision}, the trainer runs bf16={trainer.config.bf16}")
        trimmer = HeapTrimmer(args.trim_every if "trim" in measures else 0)
        steps = [0]
        shapes: set[tuple[int, ...]] = set()

        pending: list[dict] = []  # samples waiting for the end of the current step

        def after_step(optimizer, *_):
            steps[0] += 1
            while pending:  # activations are freed here; weights, gradients and Adam's moments are not
                rss, entry = resident_memory_bytes(), pending.pop()
                entry["rss_between_steps_mb"] = round(rss / 2**20, 1) if rss else None
                entry["between_steps_minutes"] = round((time.perf_counter() - start) / 60, 3)
            trimmer.step(steps[0])  # after the reading: a trim never flatters a sample

        trainer.optimizer.register_step_post_hook(after_step)
        forward = trainer.model.loss

        def counting_loss(src, tgt_in, *rest, **kwargs):
            shapes.add((src.size(0), src.size(1), tgt_in.size(1)))
            return forward(src, tgt_in, *rest, **kwargs)

        trainer.model.loss = counting_loss  # the Trainer picks model.loss when train() starts
        samples: list[dict] = []
        stop = threading.Event()
        start = time.perf_counter()

        def sample() -> None:
            rss, hwm = resident_memory_bytes(), peak_resident_memory_bytes()
            heap = heap_stats()
            samples.append(
                {
                    "minutes": round((time.perf_counter() - start) / 60, 3),
                    "step": steps[0],
                    "distinct_shapes": len(shapes),
                    "rss_mb": round(rss / 2**20, 1) if rss else None,
                    "rss_between_steps_mb": None,  # RSS at the end of the step under way (filled in then)
                    "between_steps_minutes": None,
                    "peak_rss_mb": round(hwm / 2**20, 1) if hwm else None,
                    "heap_mb": {k: round(v / 2**20, 1) for k, v in heap.items()} if heap else None,
                    "loadavg": round(os.getloadavg()[0], 2),
                }
            )
            pending.append(samples[-1])
            print(
                f"[{args.precision}/{args.fix}] {samples[-1]['minutes']:6.2f} min  step {steps[0]:5d}  "
                f"RSS {samples[-1]['rss_mb']} MB  shapes {len(shapes)}",
                flush=True,
            )

        def sampler() -> None:
            sample()
            while not stop.wait(args.interval - (time.perf_counter() - start) % args.interval):
                sample()

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state = trainer.train()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
        stop.set()
        thread.join()
        sample()  # the end of the run, between steps
        samples[-1]["rss_between_steps_mb"] = samples[-1]["rss_mb"]
        samples[-1]["between_steps_minutes"] = samples[-1]["minutes"]
        pending.clear()
    result = {
        "precision": args.precision,
        "fix": args.fix,
        "settings": {**applied, "rows_padded": qkv.runtime.padded_linear.PAD_ROWS},
        "trim_every_steps": trimmer.every_steps,
        "trim_calls": trimmer.calls,
        "trim_ms_per_call": round(1000 * trimmer.seconds / trimmer.calls, 2) if trimmer.calls else None,
        "rss_mb_before_data": round(rss_before / 2**20, 1) if rss_before else None,
        "steps": state.step,
        "epochs": state.epoch,
        "target_tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        # page faults that needed no disk: memory the process got from the OS afresh and touched
        "minor_page_faults_per_step": round(faults / max(state.step, 1)),
        "distinct_shapes": len(shapes),
        "samples": samples,
    }
    Path(args.child_out).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- parent
def flatness(samples: list[dict], warmup_minutes: float, tolerance: float, key: str = "rss_between_steps_mb") -> dict:
    """Max/min of the ``key`` samples taken after ``warmup_minutes``, and a least-squares slope."""
    when = "between_steps_minutes" if key == "rss_between_steps_mb" else "minutes"
    late = [s for s in samples if s.get(key) is not None and s[when] >= warmup_minutes]
    if len(late) < 2:
        return {"warmup_minutes": warmup_minutes, "samples": len(late), "ratio": None, "flat": None}
    rss = [s[key] for s in late]
    minutes = [s[when] for s in late]
    mean_t, mean_r = sum(minutes) / len(minutes), sum(rss) / len(rss)
    var = sum((t - mean_t) ** 2 for t in minutes)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(minutes, rss)) / var if var else 0.0
    ratio = max(rss) / min(rss)
    return {
        "warmup_minutes": warmup_minutes,
        "samples": len(late),
        "min_mb": min(rss),
        "max_mb": max(rss),
        "ratio": round(ratio, 4),
        "flat": ratio <= 1 + tolerance,
        "tolerance": tolerance,
        "slope_mb_per_minute": round(slope, 2),
    }


def label(run: dict) -> str:
    if run["fix"] == "none":
        return f"{run['precision']}, no fix"
    cache = f"oneDNN cache {(run.get('settings') or {}).get('onednn_primitive_cache') or '?'}"
    names = {
        "fix": f"trim every {run.get('trim_every_steps', '?')} steps + {cache} + rows padded + heap top kept",
        "trim": f"trim every {run.get('trim_every_steps', '?')} steps",
        "onednn": cache,
        "pad": "rows padded (qkv.runtime.padded_linear)",
        "top": "heap top kept (qkv.runtime.heap.keep_heap_top)",
        "mmap": f"mmap >= {(run.get('settings') or {}).get('mmap_threshold') or 0:,} B",
    }
    parts = [part.partition("=")[0] for part in run["fix"].split("+")]
    return f"{run['precision']}, " + " + ".join(names.get(part, part) for part in parts)


def plot_title(machine: dict) -> str:
    # reports written before machine_info used environment() name the CPU "cpu" and its kernels "torch_cpu_capability"
    cpu = machine.get("cpu_model") or machine.get("cpu")
    capability = machine.get("cpu_capability") or machine.get("torch_cpu_capability")
    return (
        f"Resident memory, Multi30k en-de training (library recipe)\n{cpu} "
        f"({capability}), {machine['torch_threads']} threads, torch {machine['torch']}"
    )


def plot(runs: list[dict], path: Path, warmup_minutes: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qkv.runtime.fileio import atomic_path

    fig, ax = plt.subplots(figsize=(8, 6))
    for index, run in enumerate(runs):
        color = f"C{index}"
        between = [
            (s["between_steps_minutes"], s["rss_between_steps_mb"])
            for s in run["samples"]
            if s.get("rss_between_steps_mb") is not None
        ]
        f = run["flatness"]
        extra = f" (after warm-up: max/min {f['ratio']:.3f})" if f.get("ratio") else ""
        ax.plot(
            [x for x, _ in between],
            [y for _, y in between],
            "o-",
            color=color,
            markersize=3,
            label=f"{label(run)}: between steps{extra}",
        )
        ax.plot(
            [s["minutes"] for s in run["samples"]],
            [s["rss_mb"] for s in run["samples"]],
            ":",
            color=color,
            linewidth=1,
            alpha=0.7,
            label=f"{label(run)}: at any moment (mid-step activations included)",
        )
    ax.axvspan(0, warmup_minutes, color="0.92", label="warm-up")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("resident memory (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=1, frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--minutes", type=float, default=20.0, help="training minutes a run")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between RSS samples")
    p.add_argument("--warmup-minutes", type=float, default=3.0, help="samples before this are warm-up")
    p.add_argument("--tolerance", type=float, default=0.10, help="flat: max/min after warm-up <= 1 + this")
    p.add_argument(
        "--precisions",
        default="auto",
        help="comma list of float32, bf16; auto: float32, and bf16 where this machine runs it fast",
    )
    p.add_argument(
        "--fixes",
        default="none,fix",
        help=f"comma list of variants to run in turn: none, or +-joined measures from {MEASURES} "
        f"or {tuple(COMPOSITES)}",
    )
    p.add_argument("--trim-every", type=int, default=50, help="steps between heap trims (the trim measure)")
    p.add_argument("--mmap-threshold", type=int, default=2**20, help="bytes (the mmap measure)")
    p.add_argument(
        "--onednn-capacity",
        type=int,
        default=ONEDNN_CACHE_CAPACITY,
        help="primitives oneDNN may cache (the onednn measure; default: qkv's)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "performance" / "memory.json"),
        help="the result JSON; an existing file (or --figure) is kept unless --overwrite",
    )
    p.add_argument("--figure", default=str(REPO / "docs" / "figures" / "memory.png"))
    # declared by hand, not by qkv.bench.results.add_result_options: importing qkv.bench imports torch, which a
    # child must not do before its start-up memory settings (limit_memory_growth)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out and --figure")
    p.add_argument("--replot", action="store_true", help="redraw --figure from the --out JSON; no training")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--fix", default="none", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.child:
        return child(args)
    if args.replot:
        report = json.loads(Path(args.out).read_text())
        plot(report["runs"], Path(args.figure), report["warmup_minutes"], plot_title(report["machine"]))
        return 0

    import torch

    from qkv.bench.provenance import write_result
    from qkv.bench.results import check_result_file
    from qkv.runtime.precision import bf16_is_fast, slow_bf16_reason

    check_result_file(p, args)  # before any work
    check_result_file(p, args, flag="--figure")
    from qkv.data import resolve_multi30k

    try:  # the children get the folder found: --data, $QKV_DATA/multi30k or the cache (as qkv train)
        args.data = str(resolve_multi30k(args.data).resolve())
    except FileNotFoundError as err:
        p.error(str(err))

    torch.set_num_threads(args.threads)
    fixes = [f.strip() for f in args.fixes.split(",") if f.strip()]
    for fix in fixes:
        try:
            measures_of(fix)
        except ValueError as err:
            p.error(str(err))
    precisions, skipped = [], {}
    for name in ["float32", "bf16"] if args.precisions == "auto" else args.precisions.split(","):
        if name not in ("float32", "bf16"):
            p.error(f"unknown precision {name!r}")
        if name == "bf16" and not bf16_is_fast("cpu"):
            skipped["bf16"] = slow_bf16_reason("cpu")
            if args.precisions == "auto":
                continue
            logging.warning("bf16 asked for although slow here: %s", skipped.pop("bf16"))
        precisions.append(name)
    machine = machine_info(args.threads)
    runs = []
    for precision in precisions:
        for fix in fixes:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
                child_out = handle.name
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--precision",
                precision,
                "--fix",
                fix,
                "--child-out",
                child_out,
                "--data",
                args.data,
                "--minutes",
                str(args.minutes),
                "--interval",
                str(args.interval),
                "--trim-every",
                str(args.trim_every),
                "--mmap-threshold",
                str(args.mmap_threshold),
                "--onednn-capacity",
                str(args.onednn_capacity),
                "--threads",
                str(args.threads),
            ]
            logging.info("run: %s", " ".join(cmd[1:]))
            try:
                subprocess.run(cmd, check=True)
                run = json.loads(Path(child_out).read_text())
            finally:
                os.unlink(child_out)
            run["flatness"] = flatness(run["samples"], args.warmup_minutes, args.tolerance)
            run["flatness_any_moment"] = flatness(run["samples"], args.warmup_minutes, args.tolerance, "rss_mb")
            logging.info("%s: %s", label(run), run["flatness"])
            runs.append(run)
    first = {}  # each run's steps against the first fix's run in the same precision (same minutes)
    for run in runs:
        base = first.setdefault(run["precision"], run)
        run["steps_vs_first_fix"] = round(run["steps"] / max(base["steps"], 1), 3)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "resident memory during Multi30k en->de training (the library recipe; no validation or "
        "checkpoints inside the window)",
        "command": " ".join(["python"] + sys.argv),
        "minutes": args.minutes,
        "interval_seconds": args.interval,
        "warmup_minutes": args.warmup_minutes,
        "tolerance": args.tolerance,
        "all_flat": all(r["flatness"]["flat"] for r in runs) if runs else None,
        "skipped": skipped,
        "machine": machine,
        "runs": runs,
    }
    write_result(args.out, report)
    plot(runs, Path(args.figure), args.warmup_minutes, plot_title(machine))
    for run in runs:
        f = run["flatness"]
        print(
            f"{label(run):24s} steps {run['steps']:5d}  minor faults/step {run.get('minor_page_faults_per_step')}  "
            f"RSS after warm-up {f.get('min_mb')}-{f.get('max_mb')} MB  "
            f"max/min {f.get('ratio')}  flat: {f.get('flat')}"
        )
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
