"""A decoding step's matrix products, timed alone: PyTorch's (what qkv's decoding calls) against onnxruntime's.

onnxruntime runs qkv's own ONNX export of the decoder step at about CTranslate2's speed (docs/deploy.md's
table), while qkv's PyTorch step is slower; its profile says half of a step is the products by a weight.
This benchmark asks whether the kernels themselves differ: for each product of a step of the Multi30k
recipe's decoder (the fused q/k/v projection, the 256 x 256 ones, the feed-forward network's two, the
projection onto the vocabulary), it times ``x (rows, in) @ W.T + b`` with

* ``torch_linear``: ``F.linear`` (PyTorch's BLAS, MKL in the pip wheels),
* ``torch_onednn_packed``: oneDNN with the weight packed once (qkv's ``PackedLinear`` where it packs),
* ``onnxruntime``: a one-node ``MatMul`` + ``Add`` graph with the weight as a constant, which onnxruntime
  prepacks for its own GEMM (MLAS); the time includes its ``run`` call's overhead. Its idle threads
  sleep instead of spinning (one session per product lives here; spinning ones would take the cores).

Each product is timed two ways: ``alone`` (the same weight again and again: it stays in the cache) and
``in_step`` (every weight of one decoder step in turn, as a step reads them; the time is per step). The
engines take turns round by round; a time is the median of --rounds. Same inputs for every engine;
the outputs are checked to agree within 1e-4.

Writes benchmarks/results/deploy/decoding_products.json.

    python benchmarks/decoding_products.py                  # the Multi30k recipe's sizes, 16 and 80 rows, 1 and 2 threads
    python benchmarks/decoding_products.py --quick --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.cli.options import positive_int
from qkv.runtime.machine import environment

OUT = Path(__file__).resolve().parent / "results" / "deploy" / "decoding_products.json"
Product = Callable[[], object]


def step_shapes(d_model: int, d_ff: int, vocab: int) -> dict[str, tuple[int, int]]:
    """One decoder layer's products and the output projection, ``name -> (out, in)``, as qkv's
    ``FastSteps`` computes them (the self-attention's q/k/v fused into one product)."""
    return {
        "self q/k/v (fused)": (3 * d_model, d_model),
        "self out": (d_model, d_model),
        "cross q": (d_model, d_model),
        "cross out": (d_model, d_model),
        "feed-forward 1": (d_ff, d_model),
        "feed-forward 2": (d_model, d_ff),
        "vocabulary projection": (vocab, d_model),
    }


def onnx_product(weight: np.ndarray, bias: np.ndarray, rows: int, threads: int) -> Callable[[np.ndarray], object]:
    """An onnxruntime session computing ``x @ weight.T + bias`` for ``x (rows, in)``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out_f, in_f = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, in_f])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, out_f])],
        [numpy_helper.from_array(np.ascontiguousarray(weight.T), "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # many sessions live side by side here: idle pool threads that spin would take the cores from the
    # one that runs (a decoder has one session, where spinning pays; here it does not)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


def engines_for(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, threads: int) -> dict[str, Product]:
    """The three ways to compute ``F.linear(x, weight, bias)``, as calls without arguments."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    ort_call, x_np = onnx_product(weight.numpy(), bias.numpy(), x.size(0), threads), x.numpy()
    return {
        "torch_linear": lambda: F.linear(x, weight, bias),
        "torch_onednn_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
        "onnxruntime": lambda: ort_call(x_np),
    }


def timed(calls: list[Product], repeats: int) -> float:
    """Seconds for one pass over ``calls``, averaged over ``repeats`` passes (after one warm-up pass)."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / repeats


def measure(shapes: dict[str, tuple[int, int]], layers: int, rows: int, threads: int, rounds: int) -> dict:
    """Per product ``alone`` and the whole step ``in_step`` for every engine, microseconds, medians of ``rounds``."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    per_product: dict[str, dict[str, Product]] = {}
    step: dict[str, list[Product]] = {}
    worst = 0.0
    for name, (out_f, in_f) in shapes.items():
        copies = 1 if name == "vocabulary projection" else layers  # a layer's weights are distinct in each layer
        for copy in range(copies):
            weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
            bias, x = torch.randn(out_f, generator=gen), torch.randn(rows, in_f, generator=gen)
            calls = engines_for(weight, bias, x, threads)
            want = F.linear(x, weight, bias)
            for engine, call in calls.items():
                got = torch.as_tensor(call())
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
                step.setdefault(engine, []).append(call)
            if copy == 0:
                per_product[name] = calls
    if worst > 1e-4:
        raise AssertionError(f"the engines disagree: relative difference {worst:.2e}")
    alone: dict[str, dict[str, list[float]]] = {name: {} for name in per_product}
    in_step: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, calls in per_product.items():
            repeats = max(3, int(2e7 / (rows * shapes[name][0] * shapes[name][1])))
            for engine, call in calls.items():
                alone[name].setdefault(engine, []).append(timed([call], repeats))
        for engine, step_calls in step.items():
            in_step.setdefault(engine, []).append(timed(step_calls, 5))
    us = {name: {e: round(1e6 * statistics.median(t), 1) for e, t in per.items()} for name, per in alone.items()}
    for per in us.values():
        per["torch_best_over_onnxruntime"] = round(
            min(per["torch_linear"], per["torch_onednn_packed"]) / per["onnxruntime"], 2
        )
    step_us = {e: round(1e6 * statistics.median(t), 1) for e, t in in_step.items()}
    step_us["torch_linear_over_onnxruntime"] = round(step_us["torch_linear"] / step_us["onnxruntime"], 2)
    return dict(alone_us=us, in_step_us=step_us, max_relative_difference=float(f"{worst:.2e}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=positive_int, default=256, help="model width (default: the Multi30k recipe's 256)")
    p.add_argument("--d-ff", type=positive_int, default=1024, help="feed-forward width (default 1024)")
    p.add_argument("--vocab", type=positive_int, default=8000, help="target vocabulary (default 8000)")
    p.add_argument("--layers", type=positive_int, default=3, help="decoder layers, for the in-step times (default 3)")
    p.add_argument(
        "--rows", type=positive_int, nargs="+", default=[16, 80], help="rows: sentences x beam (default 16 80)"
    )
    p.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timing rounds, the median is kept (default 7)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 16 rows, 1 thread, 1 round: checks the plumbing")
    add_result_options(p, OUT)
    args = p.parse_args(argv)
    args.out = check_result_file(p, args)
    if args.quick:
        vars(args).update(d_model=32, d_ff=64, vocab=100, layers=1, rows=[16], threads=[1], rounds=1)
    shapes = step_shapes(args.d_model, args.d_ff, args.vocab)
    threads_before = torch.get_num_threads()
    results: dict[str, dict[str, dict]] = {}
    try:
        with torch.inference_mode():
            for threads in args.threads:
                for rows in args.rows:
                    print(f"{threads} thread(s), {rows} rows ...", file=sys.stderr, flush=True)
                    results.setdefault(str(threads), {})[str(rows)] = measure(
                        shapes, args.layers, rows, threads, args.rounds
                    )
    finally:
        torch.set_num_threads(threads_before)
    report = dict(
        settings=dict(
            d_model=args.d_model,
            d_ff=args.d_ff,
            vocab=args.vocab,
            layers=args.layers,
            rounds=args.rounds,
            shapes={name: list(shape) for name, shape in shapes.items()},
            torch=torch.__version__,
            onnxruntime=__import__("onnxruntime").__version__,
        ),
        threads=results,
    )
    report["machine"] = environment()
    write_result(args.out, report, ["benchmarks/decoding_products.py", *(sys.argv[1:] if argv is None else argv)])
    for threads, per_rows in results.items():
        for rows, r in per_rows.items():
            print(f"{threads} thread(s), {rows} rows: one step's products {r['in_step_us']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
