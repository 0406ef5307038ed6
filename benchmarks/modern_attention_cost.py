"""What each part of today's attention costs a small qkv language model on one CPU core: time of a
training step, time of a cached decoding step, and the key/value cache's bytes, each as a ratio to
GPT-2's layout, side by side in one run.

The model: a :class:`qkv.CausalLM` of d_model 256, 4 layers, 8 heads, d_ff 1024, context 1024,
vocabulary 2,000 (the BPE size of the tinyshakespeare recipe), float32, dropout 0. The baseline is
GPT-2's layout (learned positions, LayerNorm, tanh-GELU, biases, tied output); every other variant
changes one thing from it (:data:`VARIANTS`), and ``llama_style`` changes several at once. SwiGLU's
d_ff is 2/3 of the baseline's (683), so that its three products hold the parameters the baseline's two
do (within 0.1%: the JSON lists every variant's parameter count).

* ``train_step``: forward and backward of :meth:`qkv.CausalLM.loss` on 8 x 256 tokens (gradients
  cleared before each; no optimizer step).
* ``decode``: per new token, greedy, batch 1, :meth:`qkv.CausalLM.forward` with the cache (the path
  :meth:`qkv.CausalLM.generate` takes), over ``--decode-steps`` tokens after a 512-token prompt
  (the prompt's cache built once, untimed).
* ``kv_cache``: the bytes of every layer's cached keys and values after the prompt and the decoded
  tokens, per token held and in all (a sliding window holds only its last window - 1 tokens).

Each measure times its variants in interleaved rounds (the order rotated each round, as
:func:`qkv.bench.timing.time_interleaved` does) and reports, for the process's CPU time and for the
wall clock, medians and the median over rounds of each round's ratio to the baseline. On a shared core
the CPU time is the figure to read: it leaves out the time spent waiting for other processes. Run it
on one core:

    taskset -c 0 python benchmarks/modern_attention_cost.py \\
        --out benchmarks/results/attention/modern_attention_cost_epyc.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from qkv.attention.multihead import KVCache
    from qkv.models.causal_lm import CausalLM

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention" / "modern_attention_cost_epyc.json"
BASE: dict[str, Any] = dict(
    vocab_size=2000, d_model=256, num_heads=8, num_layers=4, d_ff=1024, context=1024, dropout=0.0
)
GATED_D_FF = round(2 * BASE["d_ff"] / 3)  # three products of this width hold what two of d_ff hold
# name -> the CausalLMConfig fields that differ from the baseline's (GPT-2's layout)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "rotary": {"positional": "rotary"},
    "alibi": {"positional": "alibi"},
    "rmsnorm": {"norm": "rms"},
    "swiglu": {"activation": "swiglu", "d_ff": GATED_D_FF},
    "qk_norm": {"qk_norm": True},  # a LayerNorm over each head's queries and keys (the baseline's norm)
    "kv_heads_4": {"num_kv_heads": 4},
    "kv_heads_2": {"num_kv_heads": 2},
    "kv_heads_1": {"num_kv_heads": 1},
    "window_128": {"sliding_window": 128},
    "llama_style": {
        "positional": "rotary",
        "norm": "rms",
        "activation": "swiglu",
        "d_ff": GATED_D_FF,
        "bias": False,
        "num_kv_heads": 2,
    },
}
BATCH, SEQ, PROMPT = 8, 256, 512


def build(options: dict[str, Any]) -> CausalLM:
    """The variant's model (seed 0), in float32 on the CPU."""
    import torch

    from qkv.models.causal_lm import CausalLM, CausalLMConfig

    torch.manual_seed(0)
    return CausalLM(CausalLMConfig(**(BASE | options)))


def cache_bytes(cache: list[KVCache]) -> dict[str, int]:
    """The cache's keys and values in bytes: as tensors (``logical``) and as the storages they hold
    (``storage``: more where a key is a view into a larger product), and the tokens it holds."""
    tensors = [t for layer in cache for t in (layer.key, layer.value)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {
        "logical": sum(t.numel() * t.element_size() for t in tensors),
        "storage": sum(storages.values()),
        "tokens_held": len(cache[0]),
    }


def contenders(models: dict[str, CausalLM], decode_steps: int) -> tuple[dict, dict, dict]:
    """Each variant's training-step and decoding callables, and its cache's bytes."""
    import torch

    generator = torch.Generator().manual_seed(1)
    vocab: int = BASE["vocab_size"]
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=generator)
    train, decode, caches = {}, {}, {}
    for name, model in models.items():

        def step(model: CausalLM = model) -> None:
            model.train()
            model.zero_grad(set_to_none=True)
            model.loss(inputs, targets).backward()

        with torch.no_grad():
            model.eval()
            first = model(prompt)
        start_cache, start_token = first.cache, first.logits[:, -1:].argmax(-1)

        def tokens(
            model: CausalLM = model, start_cache: list[KVCache] = start_cache, start_token: Tensor = start_token
        ) -> list[KVCache]:
            model.eval()
            cache, token = start_cache, start_token
            with torch.no_grad():
                for _ in range(decode_steps):
                    out = model(token, cache=cache)
                    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            return cache

        train[name], decode[name] = step, tokens
        caches[name] = {"after_prompt": cache_bytes(start_cache), "after_decoding": cache_bytes(tokens())}
    return train, decode, caches


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, dict[str, list]]:
    """Each call's wall-clock and CPU seconds over ``repeats`` rounds, after ``warmup`` untimed calls
    of each. A round calls every one, starting one later each round (as
    :func:`qkv.bench.timing.time_interleaved`), so load from other processes falls on all alike; CPU
    time is the process's own (one torch thread), which waiting for a shared core does not add to."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, dict[str, list]] = {name: {"wall": [], "cpu": []} for name in calls}
    names = list(calls)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            calls[name]()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def summarize(times: dict[str, dict[str, list]], per: int = 1) -> dict[str, dict[str, Any]]:
    """Each variant's median milliseconds (per ``per`` units of work), CPU and wall-clock, and the
    median over rounds of each round's ratio to the baseline's."""
    from qkv.bench.timing import paired_ratio

    base = times["baseline"]
    out: dict[str, dict[str, Any]] = {}
    for name, measured in times.items():
        out[name] = {"rounds": len(measured["cpu"])}
        for clock in ("cpu", "wall"):
            out[name][f"{clock}_median_ms"] = round(1e3 * statistics.median(measured[clock]) / per, 3)
            over = paired_ratio(measured[clock], base[clock])
            out[name][f"{clock}_over_baseline"] = None if over is None else round(over, 3)
        out[name]["cpu_ratio_each_round"] = [round(a / b, 3) for a, b in zip(measured["cpu"], base["cpu"])]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build every variant, time the two measures in interleaved rounds, read the caches."""
    import torch

    from qkv.bench.timing import peak_memory_bytes

    torch.set_num_threads(args.threads)
    names = args.variants or list(VARIANTS)
    if "baseline" not in names:
        names = ["baseline", *names]
    models = {name: build(VARIANTS[name]) for name in names}
    train, decode, caches = contenders(models, args.decode_steps)
    train_times = interleaved(train, args.repeats, warmup=2)
    decode_times = interleaved(decode, args.repeats, warmup=1)
    base_cache = caches["baseline"]["after_decoding"]
    rows = {}
    for name, model in models.items():
        held = caches[name]["after_decoding"]
        per_token = held["logical"] / held["tokens_held"]
        rows[name] = {
            "changes": VARIANTS[name],
            "parameters": sum(p.numel() for p in model.parameters()),
            "kv_cache": {
                **caches[name],
                "bytes_per_token_held": per_token,
                "per_token_over_baseline": round(per_token / (base_cache["logical"] / base_cache["tokens_held"]), 4),
                "total_over_baseline": round(held["logical"] / base_cache["logical"], 4),
            },
        }
    train_summary, decode_summary = summarize(train_times), summarize(decode_times, per=args.decode_steps)
    for name in rows:
        peaks = [peak_memory_bytes(train[name], torch.device("cpu")) for _ in range(3)]  # after the timed rounds
        known = [p for p in peaks if p is not None]
        peak = int(statistics.median(known)) if len(known) == len(peaks) else None
        rows[name]["train_step"] = {**train_summary[name], "peak_bytes_one_call": peak}
        rows[name]["decode_per_token"] = decode_summary[name]
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "variants": rows}


def headline(rows: dict[str, Any]) -> dict[str, Any]:
    """A few of the ratios to the baseline, for the results index."""
    pick = {
        "alibi train step": ("alibi", "train_step"),
        "window 128 train step": ("window_128", "train_step"),
        "swiglu train step": ("swiglu", "train_step"),
        "kv heads 1 decode": ("kv_heads_1", "decode_per_token"),
        "llama style train step": ("llama_style", "train_step"),
        "llama style decode": ("llama_style", "decode_per_token"),
    }
    out = {f"{label} x": rows[name][part]["cpu_over_baseline"] for label, (name, part) in pick.items() if name in rows}
    if "llama_style" in rows:
        out["llama style kv cache per token x"] = rows["llama_style"]["kv_cache"]["per_token_over_baseline"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all (the baseline always)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds of each measure (default 9)")
    parser.add_argument("--decode-steps", type=int, default=32, help="tokens decoded per timed sample (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    from qkv.bench.results import add_result_options, check_result_file

    add_result_options(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    out = check_result_file(parser, args)
    if args.repeats < 1 or args.decode_steps < 1 or args.threads < 1:
        parser.error("--repeats, --decode-steps and --threads must be at least 1")
    from qkv.bench.provenance import write_result

    load_before = os.getloadavg()
    result = measure(args)
    report = dict(
        what="the cost of each part of today's attention in a small qkv CausalLM on one CPU core: training "
        "step, cached decoding per token and KV-cache bytes, each as a ratio to GPT-2's layout",
        settings=dict(
            model=BASE,
            gated_d_ff=GATED_D_FF,
            gated_d_ff_why="SwiGLU's three products of 2/3 the width hold the parameters of the baseline's two",
            dtype="float32",
            train_step=f"forward + backward of CausalLM.loss on {BATCH} x {SEQ} tokens, no optimizer step",
            decode=f"greedy, batch 1, {args.decode_steps} cached steps after a {PROMPT}-token prompt; per token",
            repeats=args.repeats,
            timing="rounds interleaved, order rotated, after untimed warm-up calls; cpu_* from the process's "
            "CPU time (one torch thread: what the work cost, without the waits for a shared core), wall_* from "
            "the wall clock; *_over_baseline is the median over rounds of each round's ratio to the baseline",
            peak_bytes="train_step.peak_bytes_one_call: the median of 3 more steps after the timed rounds, each "
            "qkv.bench.timing.peak_memory_bytes: the resident-set high-water mark above the live set (a few "
            "MiB of allocator noise)",
            kv_cache="logical: the cached key and value tensors' bytes; storage: the storages they hold (more "
            "after the prompt, where the keys and values are views into the prompt's fused q/k/v product, "
            "until the first cached step makes tensors of their own)",
            cpu_affinity=sorted(os.sched_getaffinity(0)),
        ),
        note="run under taskset -c 0 with torch threads 1, the other core kept for another benchmark; the "
        "machine is shared (other work ran on both cores, load averages below), so absolute times are "
        "noisy and the ratios, from interleaved rounds, are the figures to read",
        load_average_1min=dict(before=round(load_before[0], 2), after=round(os.getloadavg()[0], 2)),
        **result,
    )
    report["headline"] = headline(result["variants"])
    write_result(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
