"""``qkv bench``: time qkv against PyTorch and Hugging Face side by side (a thin front end over
:mod:`qkv.bench.suites`; the scripts in ``benchmarks/`` run the same suites)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qkv.bench.suites import SUITES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv bench``'s flags: the suite to time (or ``all``), ``--quick``, where the results
    go (``--out``, ``--overwrite``), the device, threads, data and seed, and the attention suite's
    sizes, dtypes, passes and contenders.

    Args:
        parser: the ``bench`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("suite", choices=(*SUITES, "all"), help="what to time")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny sizes, few repeats)")
    parser.add_argument(
        "--out",
        default="benchmarks/results/performance",
        help="folder for <suite>.json and <suite>.png (existing ones are kept unless --overwrite)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the suites' files already in --out")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--data", default=None, help="folder with the Multi30k files (default: $QKV_DATA/multi30k)")
    parser.add_argument(
        "--compile",
        dest="compile_models",
        action="store_true",
        default=None,
        help="include torch.compile contenders in the precision suite even with --quick",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seq-lens", default=None, help="attention suite: comma-separated sequence lengths (default 128,512,2048,8192)"
    )
    parser.add_argument(
        "--dtypes", default=None, help="attention suite: comma-separated, e.g. float32 (default float32,bfloat16)"
    )
    parser.add_argument(
        "--passes", default=None, help="attention suite: forward and/or forward_backward (default both)"
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help="attention suite: comma-separated contenders to time, e.g. qkv_fast,torch_sdpa (default all)",
    )


def _names(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def run(args: argparse.Namespace) -> int:
    """Run ``qkv bench``: time the chosen suites one after another, write each one's
    ``<suite>.json`` and ``<suite>.png`` to ``--out`` and print its summary table.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once every suite is timed. A result file already in ``--out`` (without
        ``--overwrite``) is refused before any timing, and a bad ``--threads`` or ``--seq-lens``
        raises; the CLI reports either as exit code 2.
    """
    from qkv.bench.suites import run_suite
    from qkv.bench.timing import pick_device
    from qkv.runtime.fileio import check_output_file

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    attention_options: dict = {
        option: _names(getattr(args, option)) for option in ("dtypes", "passes", "contenders") if getattr(args, option)
    }
    if args.seq_lens:
        try:
            attention_options["seq_lens"] = tuple(int(x) for x in _names(args.seq_lens))
        except ValueError:
            raise ValueError(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}") from None
    suites = SUITES if args.suite == "all" else (args.suite,)
    for suite in suites:  # before any timing: a rerun never replaces the results it is meant to sit beside
        for suffix in (".json", ".png"):
            check_output_file(Path(args.out) / f"{suite}{suffix}", "--out", overwrite=args.overwrite)
    for suite in suites:
        _, summary = run_suite(
            suite,
            out_dir=args.out,
            device=device,
            quick=args.quick,
            data_dir=args.data,
            compile_models=args.compile_models,
            attention_options=attention_options,
        )
        print(summary, flush=True)
        print()
    return 0
