"""Attention under a mask function on CPU: the boolean mask with qkv's attention against FlexAttention
(eager and compiled), side by side, the measurement behind qkv.attention.mask_functions.flex_is_faster.

For each mask (causal, and causal + a sliding window of --window keys) and length (--lengths: 256,
1024, 2048; b=1, h=4, d_h=64, float32) it times, in turns within one process, each contender's
forward pass (median of --repeats after two untimed calls):

* ``boolean``: ``to_bool_mask`` once, then ``qkv.scaled_dot_product_attention`` with that mask;
* ``flex_eager``: ``torch.nn.attention.flex_attention`` without compiling;
* ``flex_compiled``: ``torch.compile(flex_attention)``, its first call (compiling) reported apart.

Both flex contenders get the block mask built once beforehand (``flex_block_mask``; its build time,
and that of torch's ``create_block_mask``, are reported apart), as a model builds it once for all its
layers. Forward + backward is timed for the boolean path; FlexAttention's attempt is recorded (torch
refuses backward on CPU). Each --threads count runs in a process of its own, so each compiles its
own kernels. The load average before and after is recorded: other
work on the machine slows every contender alike, since they take turns.

    python benchmarks/mask_functions.py --out benchmarks/results/attention/mask_functions_epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention" / "mask_functions_epyc.json"
B, H, D = 1, 4, 64


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 3)


def measure(s: int, window: int | None, repeats: int) -> dict[str, Any]:
    """One mask at one length: each contender's median milliseconds and the one-off costs."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import qkv
    from qkv.attention import mask_functions as mf

    fn = mf.causal() if window is None else mf.sliding_window(window)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, s, D, generator=generator) for _ in range(3))
    build = {
        "to_bool_mask_ms": _median_ms([_timed(lambda: mf.to_bool_mask(fn, B, H, s, s)) for _ in range(repeats)]),
        "flex_block_mask_ms": _median_ms([_timed(lambda: mf.flex_block_mask(fn, B, H, s, s)) for _ in range(repeats)]),
        "torch_create_block_mask_ms": _median_ms(
            [_timed(lambda: create_block_mask(fn, None, None, s, s, device="cpu")) for _ in range(3)]
        ),
    }
    mask = mf.to_bool_mask(fn, B, H, s, s)
    block_mask = mf.flex_block_mask(fn, B, H, s, s)
    compiled = torch.compile(flex_attention, dynamic=False)
    first_call_s = _timed(lambda: compiled(q, k, v, block_mask=block_mask))
    contenders = {
        "boolean": lambda: qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "flex_eager": lambda: flex_attention(q, k, v, block_mask=block_mask),
        "flex_compiled": lambda: compiled(q, k, v, block_mask=block_mask),
    }
    reference = contenders["boolean"]()
    max_abs_diff = {name: float((call() - reference).abs().max()) for name, call in contenders.items()}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for call in contenders.values():
        call()
    for _ in range(repeats):  # in turns, so a change in the machine's load falls on every contender
        for name, call in contenders.items():
            times[name].append(_timed(call))
    forward = {name: _median_ms(t) for name, t in times.items()}

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def boolean_step() -> None:
        qkv.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).sum().backward()

    boolean_step()
    backward = {"boolean": _median_ms([_timed(boolean_step) for _ in range(repeats)])}
    try:
        flex_attention(qg, kg, vg, block_mask=block_mask).sum().backward()
        backward["flex"] = "ran"
    except NotImplementedError as err:
        backward["flex"] = f"refused: {err}".split(". ")[0]
    return dict(
        seq_len=s,
        mask="causal" if window is None else f"causal + window {window}",
        forward_median_ms=forward,
        forward_over_boolean={name: round(ms / forward["boolean"], 3) for name, ms in forward.items()},
        forward_backward_median_ms=backward,
        flex_compiled_first_call_s=round(first_call_s, 2),
        mask_build=build,
        block_mask_sparsity_percent=round(float(block_mask.sparsity()), 1),
        max_abs_diff_vs_boolean=max_abs_diff,
    )


def worker(args: argparse.Namespace) -> None:
    """All masks and lengths at one thread count; print the rows as one JSON line."""
    import torch

    torch.set_num_threads(args.threads[0])
    warnings.simplefilter("ignore")  # torch's advice to compile flex_attention: measured here on purpose
    rows = [measure(s, window, args.repeats) for s in args.lengths for window in (None, args.window)]
    print(json.dumps(dict(threads=torch.get_num_threads(), torch=torch.__version__, rows=rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--window", type=int, default=128, help="the sliding window's keys (default 128)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    from qkv.bench.results import add_result_options, check_result_file

    add_result_options(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from qkv.bench.provenance import write_result

    out = check_result_file(parser, args)
    load_before = os.getloadavg()
    runs = []
    for threads in args.threads:
        command = [sys.executable, __file__, "--worker", "--threads", str(threads), "--repeats", str(args.repeats)]
        command += ["--window", str(args.window), "--lengths", *map(str, args.lengths)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = dict(
        what="attention under a mask function on CPU, forward (and forward + backward): qkv's boolean mask "
        "against FlexAttention eager and compiled, causal and causal + window",
        settings=dict(
            batch=B,
            heads=H,
            head_dim=D,
            dtype="float32",
            window=args.window,
            repeats=args.repeats,
            timing="contenders in turns within one process per thread count; median after two untimed calls; "
            "block and boolean masks built once beforehand (their build times reported apart)",
        ),
        load_average_1min=dict(before=round(load_before[0], 2), after=round(os.getloadavg()[0], 2)),
        runs=runs,
        headline=_headline(runs, args),
        decision=(
            "qkv.attention.mask_functions.flex_is_faster: compiled FlexAttention on CPU for inference (no grad, "
            "no dropout, float32) with at least FLEX_MIN_QUERIES queries; the boolean mask otherwise. Eager flex "
            "is never chosen; its backward is refused on CPU; each new shape compiles for seconds."
        ),
    )
    write_result(out, report)
    print(f"wrote {out}")
    return 0


def _headline(runs: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """The longest length with the window, at the first thread count: each forward's milliseconds."""
    rows = [r for r in runs[0]["rows"] if r["mask"] != "causal"]
    row = max(rows, key=lambda r: r["seq_len"])
    prefix = f"s{row['seq_len']}_window{args.window}_{runs[0]['threads']}thread"
    headline = {f"{prefix}_forward_{name}_ms": ms for name, ms in row["forward_median_ms"].items()}
    headline[f"{prefix}_flex_compile_first_call_s"] = row["flex_compiled_first_call_s"]
    return headline


if __name__ == "__main__":
    sys.exit(main())
