"""Muon's Newton-Schulz iteration: torch's (bfloat16 always) against qkv's in float32, side by side
on this machine, over the weight matrices of the tiny Shakespeare recipe's sizes (the Llama layout:
four attention projections d x d and SwiGLU's three d_ff x d / d x d_ff matrices a layer).

Each shape: the median of ``--repeats`` timed calls of torch's ``_zeropower_via_newtonschulz`` and of
:func:`qkv.training.muon.orthogonalise` (float32), one after the other in the same process, and the
largest difference between the two results. Then the iteration's milliseconds for one optimizer step
of each size (4 layers).

    python benchmarks/muon_iteration.py --out benchmarks/results/language-model/muon_iteration_MACHINE.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.training.muon import NS_COEFFICIENTS, orthogonalise

SIZES = {"tiny": 64, "small": 96, "medium": 128, "large": 192}  # d_model; d_ff = 4 d_model; 4 layers


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    add_result_options(parser, required=True)
    args = parser.parse_args()
    out = check_result_file(parser, args)
    shapes: dict[str, dict] = {}
    steps: dict[str, dict] = {}
    for name, d in SIZES.items():
        per_layer = [(d, d)] * 4 + [(4 * d, d), (4 * d, d), (d, 4 * d)]
        total = {"torch_bf16_ms": 0.0, "qkv_float32_ms": 0.0}
        for rows, cols in per_layer:
            key = f"{rows}x{cols}"
            if key not in shapes:
                g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
                theirs = median_ms(lambda g=g: _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7), args.repeats)
                ours = median_ms(lambda g=g: orthogonalise(g, 5, torch.float32), args.repeats)
                diff = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7).float() - orthogonalise(
                    g, 5, torch.float32
                )
                shapes[key] = {
                    "torch_bf16_ms": round(theirs, 3),
                    "qkv_float32_ms": round(ours, 3),
                    "ratio": round(theirs / ours, 2),
                    "max_abs_difference": round(float(diff.abs().max()), 5),
                }
            total["torch_bf16_ms"] += 4 * shapes[key]["torch_bf16_ms"]
            total["qkv_float32_ms"] += 4 * shapes[key]["qkv_float32_ms"]
        steps[name] = {k: round(v, 1) for k, v in total.items()} | {
            "ratio": round(total["torch_bf16_ms"] / total["qkv_float32_ms"], 2)
        }
        print(name, steps[name])
    report = {
        "what": "Muon's Newton-Schulz iteration (5 steps): torch's bfloat16 one against qkv's float32 one",
        "machine": {**environment(), "threads": torch.get_num_threads()},
        "shapes": shapes,
        "per_optimizer_step_4_layers": steps,
    }
    write_result(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
