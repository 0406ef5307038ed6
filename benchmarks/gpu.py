"""The GPU benchmark in one call, at most 8 minutes: training steps of qkv (eager and torch.compile)
against Hugging Face MarianMT (paper-base and paper-big sizes, ~25k-token batches of generated
WMT-like pairs or a prepared folder's) and GPT-2 small (the language model), in bf16, interleaved;
tokens/s, TFLOP/s, MFU, peak memory, a profile of a paper-base step, and the ratios qkv / HF.
The JSON is rewritten after every measurement: a run cut short keeps what it measured.

    python benchmarks/gpu.py --out benchmarks/results/gpu/gpu_h100.json         # on a GPU
    python benchmarks/gpu.py --dry-run --out /tmp/gpu_dry.json                  # CPU, tiny sizes

What it measures and how: src/qkv/bench/gpu.py (docs/gpu.md).
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the budget counts the imports below

import argparse  # noqa: E402

from qkv.bench.results import add_result_options, check_result_file  # noqa: E402


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_result_options(p, "benchmarks/results/gpu/gpu.json")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--sizes", default="paper", choices=("paper", "tiny"), help="paper (default) or tiny (CPU tests)")
    p.add_argument("--sections", default="paper-base,paper-big,lm", help="comma-separated, of paper-base,paper-big,lm")
    p.add_argument("--seconds", type=float, default=480.0, help="the whole run's wall time, imports included (480)")
    p.add_argument("--batches", type=int, default=8, help="distinct batches, each warmed up on before timing (8)")
    p.add_argument("--steps-per-round", type=int, default=5, help="timed steps per contender per round (5)")
    p.add_argument("--rounds", type=int, default=20, help="at most this many interleaved rounds per section (20)")
    p.add_argument("--no-compile", action="store_true", help="leave out qkv+compile")
    p.add_argument("--compile-seconds", type=float, default=200.0, help="torch.compile's limit per section (200)")
    p.add_argument("--profile", default="paper-base", help="sections whose steps are profiled ('' for none)")
    p.add_argument("--prepared", help="a `qkv prepare` folder to draw translation batches from (default: generated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="the git commit to record when the folder it runs in has no git history")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own; --dry-run: 1)")
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny sizes, 2 batches, 2 rounds of 1 step, no compile: a check"
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.sizes, args.batches, args.steps_per_round, args.rounds = "cpu", "tiny", 2, 1, 2
        args.no_compile = True
        args.threads = args.threads or 1  # tiny products on a shared CPU: threads only wait for each other
        args.seconds = min(args.seconds, 120.0)
    return p, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse(argv)
    out = check_result_file(parser, args)  # before any work: an existing result is kept
    import torch

    from qkv.bench.deadline import Clock
    from qkv.bench.gpu import Settings, run_benchmark

    if args.prepared:
        from qkv.data.prepared.format import is_prepared_folder

        if not is_prepared_folder(args.prepared):
            parser.error(f"--prepared {args.prepared}: not a folder written by `qkv prepare`")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: run it on a GPU, or check it with --dry-run (--device cpu --sizes tiny)")
    try:
        settings = Settings(
            device=args.device,
            sizes=args.sizes,
            sections=tuple(s for s in args.sections.split(",") if s),
            seconds=args.seconds,
            batches=args.batches,
            steps_per_round=args.steps_per_round,
            max_rounds=args.rounds,
            compile=not args.no_compile,
            compile_seconds=args.compile_seconds,
            profile=tuple(s for s in args.profile.split(",") if s),
            prepared=args.prepared,
            seed=args.seed,
            commit=args.commit,
        )
        # a few seconds kept for the last write and the interpreter's exit
        clock = Clock(args.seconds - min(15.0, 0.1 * args.seconds), started=STARTED)
        report = run_benchmark(settings, out, clock=clock, argv=None if argv is None else ["benchmarks/gpu.py", *argv])
    except ValueError as err:
        parser.error(str(err))
    print(f"{report['status']} after {report['elapsed_s']:.0f} s: {out}")
    for name, section in report["sections"].items():
        if section.get("error"):
            print(f"  {name:10s} {section['error']}")
        for contender, figures in section["contenders"].items():
            if figures.get("tokens_per_s"):
                mfu = figures.get("mfu")
                print(
                    f"  {name:10s} {contender:12s} {figures['tokens_per_s']:12.0f} tokens/s "
                    f"{figures['tflops_per_s']:8.2f} TFLOP/s  MFU {'-' if mfu is None else f'{mfu:.1%}'}"
                )
            if "summary" in figures.get("profile", {}):
                print(f"  {'':10s} {'':12s} profile: {figures['profile']['summary']}")
            if figures.get("skipped") or figures.get("error"):
                print(f"  {name:10s} {contender:12s} {figures.get('skipped') or figures.get('error')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
