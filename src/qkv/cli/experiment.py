"""``qkv experiment NAME``: run one of the explanatory experiments (or ``all``).

    qkv experiment softmax-scaling
    qkv experiment long-range --quick --out /tmp/qkv-exp
    qkv experiment all && qkv report

Each writes ``<out>/<name>/results.json`` and PNG figures and prints a short summary.
"""

from __future__ import annotations

import argparse

DEFAULT_OUT = "qkv-out/experiments"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv experiment``'s flags: the experiment's name (or ``all``), ``--quick``,
    ``--out``, ``--seed``, ``--device``, ``--threads`` and ``--no-progress``.

    Args:
        parser: the ``experiment`` subcommand's parser, to add the flags to.
    """
    from qkv.experiments import EXPERIMENTS

    names = ", ".join(f"{name} ({claim})" for name, (_, claim) in EXPERIMENTS.items())
    parser.add_argument("name", choices=[*EXPERIMENTS, "all"], metavar="NAME", help=f"one of: {names}; or all")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds; what the tests run)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv experiment``: run the named experiment (or each in turn), printing its summary,
    whether each of its claims holds, and the results and figures it wrote under ``--out``.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once every experiment has run, whether or not its claims held (the
        printed ``[holds]``/``[FAILS]`` lines say). A bad ``--threads`` raises ``ValueError``,
        which the CLI reports as exit code 2.
    """
    import torch

    from qkv.experiments import EXPERIMENTS, run_experiment

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    for name in names:
        result = run_experiment(
            name, out=args.out, quick=args.quick, seed=args.seed, device=args.device, progress=not args.no_progress
        )
        print(f"== {name}{' (quick)' if args.quick else ''}: {result.seconds:.1f} s ==")
        for line in result.summary:
            print(line)
        for claim, held in result.claims.items():
            print(f"[{'holds' if held else 'FAILS'}] {claim}")
        folder = result.folder
        if folder is None:  # run_experiment writes results.json and names its folder
            raise RuntimeError(f"experiment {name} wrote no results.json")
        figures = ", ".join(str(folder / f) for f in result.figures)
        print(f"wrote {folder / 'results.json'} and {figures}")
    return 0
