"""Where qkv's decoding time goes: torch.profiler over greedy decoding and beam search of a trained run.

Decodes --batches batches of --batch-size test sentences (length-sorted batches of the run's test set,
spread from short to long) with greedy decoding and beam search (beam 5, the power penalty), under
torch.profiler, and sorts every operator's own CPU time into what it does: the linear layers'
products (q/k/v/out projections and the feed-forward network) and the output projection onto the
vocabulary (the products by a weight, ``addmm``, ``mm`` or oneDNN's packed ``_linear_pointwise``, told
apart by their output features; the projections count the decoder steps), attention (the fused kernel),
log-softmax and top-k over the vocabulary, argmax, the KV cache's growth and reordering (``cat``,
``index_select``), layer norms, activations, element-wise arithmetic, and the rest. What the
operators do not account for of the call's wall time is Python: the decoding loop, the modules'
calls, the beam bookkeeping (and the profiler's own cost). Times per decoder step are the call's
divided by its steps.

With --before GIT_REF the same is measured for qkv's decoding as it was at that commit (before the
changes), in the same run.

Writes benchmarks/results/deploy/decoding_profile.json.

    python benchmarks/decoding_profile.py --run /work/runs/en-de --before 3f4fd5a
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decoding_engines as engines  # noqa: E402  (a sibling script, not a package)

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file  # noqa: E402
from qkv.data.sources import load_split  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402
from qkv.runtime.machine import environment  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "deploy" / "decoding_profile.json"
CATEGORIES: dict[str, tuple[str, ...]] = {  # besides the products by a weight (LINEAR_OPS, told apart by shape)
    "attention (fused scaled dot-product kernel)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "log-softmax over the vocabulary": ("aten::_log_softmax",),
    "top-k over beams x vocabulary": ("aten::topk",),
    "argmax over the vocabulary": ("aten::argmax",),
    "KV cache growth (cat)": ("aten::cat",),
    "row selection: beam reorder, finished sentences leaving (index_select)": ("aten::index_select",),
    "layer norm": ("aten::native_layer_norm",),
    "activation (gelu/relu)": ("aten::gelu", "aten::relu", "aten::clamp_min"),
    "element-wise arithmetic (residual adds, scores + log-probs, masks)": (
        "aten::add",
        "aten::mul",
        "aten::where",
        "aten::masked_fill",
        "aten::eq",
        "aten::bitwise_or",
        "aten::bitwise_and",
        "aten::bitwise_not",
        "aten::floor_divide",
        "aten::remainder",
        "aten::ne",
        "aten::ge",
        "aten::sum",
    ),
    "embedding": ("aten::embedding", "aten::index"),
}


LINEAR_OPS = ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise")  # products by a weight matrix
OUTPUT_PROJECTION = "output projection onto the vocabulary"
LINEAR_LAYERS = "linear layers (q/k/v/out projections, feed-forward)"
OTHER = "other operators (views, copies, allocation, ...)"


def _out_features(event: Any) -> int | None:
    """The output features of a product's profiled call, from its input shapes (None: not known)."""
    shapes = event.input_shapes or []
    try:
        if event.key == "aten::addmm":  # (bias, x, weight.T)
            return int(shapes[2][1])
        if event.key == "aten::mm":  # (x, weight.T)
            return int(shapes[1][1])
        return int(shapes[1][0])  # mkldnn::_linear_pointwise: (x, packed weight (o, i), ...)
    except (IndexError, TypeError):
        return None


def categorize(prof: Any, vocab: int) -> tuple[dict[str, float], float, int]:
    """Seconds of own CPU time per category (the rest under :data:`OTHER`), their total, and the decoder
    steps (the products onto the ``vocab``-token vocabulary, one a step). Products are told apart by
    their shapes: a product with ``vocab`` output features is the output projection, any other a linear layer."""
    out = dict.fromkeys([LINEAR_LAYERS, OUTPUT_PROJECTION, *CATEGORIES, OTHER], 0.0)
    lookup = {op: name for name, ops in CATEGORIES.items() for op in ops}
    total, steps = 0.0, 0
    for event in prof.key_averages(group_by_input_shape=True):
        seconds = event.self_cpu_time_total / 1e6
        if not event.key.startswith(("aten::", "mkldnn::")):
            continue  # profiler ranges, wrappers with no own work
        total += seconds
        if event.key in LINEAR_OPS:
            projection = _out_features(event) == vocab
            steps += event.count if projection else 0
            out[OUTPUT_PROJECTION if projection else LINEAR_LAYERS] += seconds
        else:
            out[lookup.get(event.key, OTHER)] += seconds
    return out, total, steps


def profile_call(call: Callable[[], object], vocab: int, repeats: int) -> dict[str, Any]:
    """``call``'s wall time (median of ``repeats``, no profiler), then one profiled call sorted by
    category: seconds, share of the operators' time, milliseconds per decoder step."""
    call()  # warm-up
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        call()
        profiled_wall = time.perf_counter() - start
    categories, total, steps = categorize(prof, vocab)
    python = max(0.0, profiled_wall - total)
    rows = {
        name: dict(seconds=round(s, 4), share_of_profiled_wall=round(s / profiled_wall, 4))
        for name, s in categories.items()
    }
    rows["outside operators: Python (loop, modules, beam bookkeeping) and profiler"] = dict(
        seconds=round(python, 4), share_of_profiled_wall=round(python / profiled_wall, 4)
    )
    for r in rows.values():
        r["ms_per_step"] = round(1000 * r["seconds"] / max(1, steps), 3)
    ranked = dict(sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]))
    return dict(
        wall_s_median=round(statistics.median(walls), 4),
        wall_s=[round(w, 4) for w in walls],
        decoder_steps=steps,
        ms_per_step=round(1000 * statistics.median(walls) / max(1, steps), 3),
        profiled_wall_s=round(profiled_wall, 4),
        operators_s=round(total, 4),
        categories=ranked,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    add_result_options(p, OUT)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=4, help="batches profiled, spread from short to long")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", default=None, metavar="GIT_REF", help="also profile qkv's decoding at this commit")
    args = p.parse_args(argv)
    args.out = check_result_file(p, args)
    torch.set_num_threads(args.threads)
    model, tok, config = load_run(args.run, "model", task="translation")
    model.eval()
    alpha = (config.get("decode") or {}).get("alpha", 0.6)
    split = load_split(config.get("data") or {}, "test")
    limit = model.config.max_len - 1
    ids = [s[:limit] + [tok.eos_id] for s in tok.encode_batch(split.src)]
    chosen = engines.timed_subset(engines.sorted_batches(ids, args.batch_size), args.batches * args.batch_size)
    versions = {"today": None} | ({f"at {args.before}": engines.search_at(args.before)} if args.before else {})
    report: dict[str, Any] = dict(
        run=str(Path(args.run).resolve()),
        settings=dict(
            threads=args.threads,
            batch_size=args.batch_size,
            batches=len(chosen),
            source_lengths=[max(len(ids[i]) for i in b) for b in chosen],
            beam=args.beam,
            alpha=alpha,
            penalty="power",
        ),
        profiles={},
    )
    for version, search in versions.items():
        decoders = engines.qkv_engines(model, tok, args.beam, alpha, False, search)
        for name in ("qkv_greedy", "qkv_beam"):

            def call(decode: engines.Decoder = decoders[name]) -> object:
                return engines.decode_all(decode, ids, chosen)

            report["profiles"][f"{name} ({version})"] = profile_call(call, model.config.tgt_vocab_size, args.repeats)
            print(version, name, report["profiles"][f"{name} ({version})"]["ms_per_step"], "ms/step")
    today = {name: report["profiles"][f"{name} (today)"]["categories"] for name in ("qkv_greedy", "qkv_beam")}
    report["headline"] = {  # the shares benchmarks/results/INDEX.md lists
        f"{name}_share_{short}": round(sum(cats[c]["share_of_profiled_wall"] for c in cats if c.startswith(prefix)), 3)
        for name, cats in today.items()
        for short, prefix in (("linear_layers", "linear layers"), ("output_projection", "output projection"))
    }
    report["machine"] = environment()
    write_result(args.out, report, ["benchmarks/decoding_profile.py", *(sys.argv[1:] if argv is None else argv)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
