"""What each of the CPU training step's fast paths buys: the Multi30k recipe's step (qkv's
:meth:`qkv.training.Trainer.step`: forward, fused loss, backward, clipping, Adam) on real Multi30k
batches, with each path turned back to what it replaced, one at a time and all together, timed
interleaved on the same batches (:func:`qkv.bench.timing.time_interleaved`). Reports target tokens/s
and each variant's ratio to today's step.

The paths:
* ``plain attention``: on CPU, with a backward to follow, sequences shorter than
  ``qkv.attention.backends.PLAIN_MAX_LEN`` run the plain product-softmax-product (the reference) in
  float32 instead of PyTorch's fused kernel in float32 (``upcast_for_cpu_backward`` for bf16);
* ``fused Adam``: ``torch.optim.Adam(fused=True)`` instead of the default per-tensor loop;
* ``512-row loss chunks``: the fused loss projects 512 rows at a time instead of 1,024
  (``qkv.nn.loss.FUSED_CHUNK_ROWS``).

    python benchmarks/cpu_step_paths.py                       # bf16 where fast, else float32
    python benchmarks/cpu_step_paths.py --repeats 40 --out benchmarks/results/performance/cpu_step_paths.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys
from pathlib import Path

import torch

import qkv.models.transformer
from qkv.attention import backends
from qkv.bench.data import multi30k_data
from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment, paired_ratio, ratio, time_interleaved
from qkv.bench.training import _ContenderTask, multi30k_config
from qkv.nn.loss import fused_linear_cross_entropy
from qkv.runs.recipes import load_recipe
from qkv.runtime.precision import bf16_is_fast
from qkv.training import TrainConfig, Trainer

REPO = Path(__file__).resolve().parent.parent
BEFORE = {"attention": "fused attention kernel", "adam": "per-tensor Adam", "chunks": "1,024-row loss chunks"}


@contextlib.contextmanager
def paths_before(which: frozenset[str]):
    """Turn the named fast paths back to what they replaced, for the duration of one step."""
    saved_plain, saved_loss = backends.PLAIN_MAX_LEN, qkv.models.transformer.fused_linear_cross_entropy
    try:
        if "attention" in which:
            backends.PLAIN_MAX_LEN = 0
        if "chunks" in which:
            qkv.models.transformer.fused_linear_cross_entropy = functools.partial(
                fused_linear_cross_entropy, chunk_rows=1024
            )
        yield
    finally:
        backends.PLAIN_MAX_LEN, qkv.models.transformer.fused_linear_cross_entropy = saved_plain, saved_loss


def recipe_data_and_model(data_dir: str | None, bf16: bool, batches: int):
    """The Multi30k recipe's real batches and model config for a run in bf16 or float32 (the recipe
    tuned for fast bf16, multi30k-bf16, when ``bf16``), as a training run of it would have them."""
    recipe = load_recipe("multi30k-bf16" if bf16 else "multi30k")
    data = multi30k_data(
        data_dir, vocab_size=recipe.vocab_size, max_tokens=recipe.train["max_tokens"], num_batches=batches
    )
    return data, multi30k_config(data, **{k: v for k, v in recipe.model.items() if k != "max_len"})


def make_step(data, config, train: TrainConfig, which: frozenset[str]):
    torch.manual_seed(0)  # every variant starts from the same weights
    model = qkv.models.transformer.Transformer(config)
    trainer = Trainer(model, _ContenderTask(model, data.pad_id), train, d_model=config.d_model)
    if "adam" in which:
        trainer.optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=train.adam_betas, eps=train.adam_eps)
    position = [0]

    def step() -> int:
        batch = data.batches[position[0] % len(data.batches)]
        position[0] += 1
        with paths_before(which):
            return trainer.step([batch]).tokens

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", default=None, help="folder with the Multi30k task-1 files (default: $QKV_DATA/multi30k or the cache)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--batches", type=int, default=30, help="real batches cycled through")
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 autocast where bf16 products are fast (as the recipe), else float32",
    )
    add_result_options(parser, REPO / "benchmarks" / "results" / "performance" / "cpu_step_paths.json")
    args = parser.parse_args(argv)
    out = check_result_file(parser, args)  # before any work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    bf16 = bf16_is_fast("cpu") if args.precision == "auto" else args.precision == "bf16"
    try:
        data, config = recipe_data_and_model(args.data, bf16, args.batches)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    train = TrainConfig(bf16=bf16, label_smoothing=0.1, progress=False)
    variants = {"today": frozenset()}
    variants.update({f"{BEFORE[name]} (before)": frozenset({name}) for name in BEFORE})
    variants["all three as before"] = frozenset(BEFORE)
    steps = {name: make_step(data, config, train, which) for name, which in variants.items()}
    timings = time_interleaved(steps, device=torch.device("cpu"), repeats=args.repeats, warmup=3)
    tokens = [b.num_tgt_tokens for b in data.batches]
    results = {}
    for name, timing in timings.items():
        timed = sum(tokens[(3 + i) % len(tokens)] for i in range(len(timing.times)))
        results[name] = {
            "tokens_per_s": round(timed / sum(timing.times), 1),
            "median_step_s": timing.median,
            "steps_timed": len(timing.times),
            "error": timing.error,
        }
    today = timings["today"]
    ratios = {
        name: {
            "today_over_it": round(ratio(results["today"]["tokens_per_s"], r["tokens_per_s"]), 3),
            "paired": round(paired_ratio(timings[name].times, today.times), 3),
        }
        for name, r in results.items()
        if name != "today"
    }
    report = {
        "what": "Multi30k recipe training step on CPU, each fast path turned back, interleaved on the same "
        "real batches; ratio = today's tokens/s over the variant's",
        "command": " ".join(["python"] + sys.argv),
        "bf16": bf16,
        "data": data.info,
        "model": {
            "d_model": config.d_model,
            "layers": [config.num_encoder_layers, config.num_decoder_layers],
            "d_ff": config.d_ff,
            "vocab": config.tgt_vocab_size,
        },
        "results": results,
        "ratios": ratios,
        "machine": environment(),
    }
    write_result(out, report)
    for name, r in results.items():
        extra = (
            ""
            if name == "today"
            else f"  today is {ratios[name]['today_over_it']:.2f}x (paired {ratios[name]['paired']:.2f}x)"
        )
        print(f"{name:32s} {r['tokens_per_s']:8.0f} target tokens/s{extra}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
