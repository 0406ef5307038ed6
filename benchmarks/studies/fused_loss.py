"""Today's fused loss (qkv.nn.loss.fused_linear_cross_entropy) against the one of an earlier commit, in one
process: the earlier ``src/qkv/nn/loss.py`` is read with ``git show`` and loaded as a module of its own,
and both are timed interleaved (:func:`qkv.bench.timing.time_interleaved`), first alone (forward and
backward of the recipe's real target positions against its 8k-token output projection) and then
inside the Multi30k recipe's whole training step (:meth:`qkv.training.Trainer.step` on real batches,
as benchmarks/cpu_step_paths.py builds it), with qkv's start-up memory settings
(``qkv.runtime.heap.limit_memory_growth``) as a training run has them. Reports each one's time and today's speed over the
earlier one's (plain and paired per round), and how far each loss and gradient lies from float64.

    python benchmarks/studies/fused_loss.py --before 1f9dd2b --out benchmarks/results/performance/fused_loss.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: cpu_step_paths, a sibling suite

import cpu_step_paths  # noqa: E402

import qkv.models.transformer  # noqa: E402
from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment, paired_ratio, ratio, time_interleaved
from qkv.nn.loss import fused_linear_cross_entropy
from qkv.runtime.heap import limit_memory_growth
from qkv.runtime.precision import bf16_is_fast
from qkv.training import TrainConfig

REPO = Path(__file__).resolve().parents[2]
SMOOTHING = 0.1


def loss_of_commit(revision: str):
    """``fused_linear_cross_entropy`` as ``src/qkv/nn/loss.py`` had it at ``revision``."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:src/qkv/nn/loss.py"], capture_output=True, text=True
    )
    if source.returncode != 0:
        raise ValueError(f"--before {revision}: {source.stderr.strip()}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "loss_before.py"
        path.write_text(source.stdout)
        spec = importlib.util.spec_from_file_location("loss_before", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.fused_linear_cross_entropy


def loss_alone(loss_fn, rows: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bf16: bool):
    """One forward and backward of ``loss_fn`` on fixed rows; returns the loss and both gradients."""
    h, w = rows.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(h, w, target, SMOOTHING, 0)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def distance_from_float64(loss_fn, rows, weight, target, bf16: bool) -> dict:
    """Relative error of the loss and of each gradient's norm-wise difference against float64."""
    h64, w64 = rows.double().requires_grad_(), weight.double().requires_grad_()
    reference = F.cross_entropy(h64 @ w64.T, target, label_smoothing=SMOOTHING, reduction="sum")  # all float64
    reference.backward()
    loss, grad_rows, grad_weight = loss_alone(loss_fn, rows, weight, target, bf16)
    return {
        "loss": abs(loss.item() - reference.item()) / reference.item(),
        "grad_hidden": ((grad_rows.double() - h64.grad).norm() / h64.grad.norm()).item(),
        "grad_weight": ((grad_weight.double() - w64.grad).norm() / w64.grad.norm()).item(),
    }


@contextlib.contextmanager
def models_use(loss_fn):
    """The Transformer's loss (qkv.models.transformer imports it by name) replaced for the duration of a step."""
    saved = qkv.models.transformer.fused_linear_cross_entropy
    qkv.models.transformer.fused_linear_cross_entropy = loss_fn
    try:
        yield
    finally:
        qkv.models.transformer.fused_linear_cross_entropy = saved


def summarise(timings: dict, work: list[float], unit: str) -> dict:
    """Per contender: median seconds and ``unit`` per second; today's speed over the earlier one's."""
    out = {
        name: {
            "median_s": t.median,
            f"{unit}_per_s": round(sum(work[: len(t.times)]) / sum(t.times), 1),
            "samples": len(t.times),
        }
        for name, t in timings.items()
    }
    today, before = list(timings)
    out["today_over_before"] = round(ratio(out[today][f"{unit}_per_s"], out[before][f"{unit}_per_s"]), 3)
    out["today_over_before_paired"] = round(paired_ratio(timings[before].times, timings[today].times), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default="1f9dd2b", help="the commit whose src/qkv/nn/loss.py is compared")
    parser.add_argument("--data", default=None, help="folder with Multi30k (default: $QKV_DATA/multi30k or the cache)")
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 autocast where bf16 products are fast (as the recipe), else float32",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds of the loss alone and of the step")
    parser.add_argument("--batches", type=int, default=30, help="real batches cycled through")
    add_result_options(parser, REPO / "benchmarks" / "results" / "performance" / "fused_loss.json")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batches < 1 or args.threads < 1:
        parser.error("--repeats, --batches and --threads must be at least 1")
    out = check_result_file(parser, args)  # before any work
    start_up = limit_memory_growth()  # as the CLI and train_multi30k.py do, before the first oneDNN primitive
    torch.set_num_threads(args.threads)
    bf16 = bf16_is_fast("cpu") if args.precision == "auto" else args.precision == "bf16"
    try:
        before = loss_of_commit(args.before)
        data, config = cpu_step_paths.recipe_data_and_model(args.data, bf16, args.batches)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    losses = {"today": fused_linear_cross_entropy, f"loss.py of {args.before}": before}

    # the loss alone, on as many positions as the recipe's batches have real targets
    torch.manual_seed(0)
    rows_per_batch = [b.num_tgt_tokens for b in data.batches]
    n = int(sorted(rows_per_batch)[len(rows_per_batch) // 2])
    rows = torch.randn(n, config.d_model)
    weight = 0.08 * torch.randn(config.tgt_vocab_size, config.d_model)
    target = torch.randint(1, config.tgt_vocab_size, (n,))
    calls = {name: (lambda f=f: loss_alone(f, rows, weight, target, bf16)) for name, f in losses.items()}
    alone = time_interleaved(calls, device=torch.device("cpu"), repeats=args.repeats, warmup=3)
    errors = {name: distance_from_float64(f, rows, weight, target, bf16) for name, f in losses.items()}

    # the whole training step
    train = TrainConfig(bf16=bf16, label_smoothing=SMOOTHING, progress=False)
    steps = {}
    for name, f in losses.items():
        step = cpu_step_paths.make_step(data, config, train, frozenset())

        def with_loss(step=step, f=f) -> int:
            with models_use(f):
                return step()

        steps[name] = with_loss
    whole = time_interleaved(steps, device=torch.device("cpu"), repeats=args.repeats, warmup=3)
    tokens = [rows_per_batch[(3 + i) % len(rows_per_batch)] for i in range(args.repeats)]

    report = {
        "what": "the fused loss of today against an earlier commit's, interleaved: alone (forward + backward "
        "of a median batch's real target positions) and in the Multi30k recipe's training step; "
        "today_over_before > 1 means today's is faster",
        "command": " ".join(["python"] + sys.argv),
        "before": args.before,
        "bf16": bf16,
        "data": data.info,
        "positions": n,
        "vocab": config.tgt_vocab_size,
        "d_model": config.d_model,
        "loss_alone": summarise(alone, [n] * args.repeats, "positions"),
        "training_step": summarise(whole, tokens, "target_tokens"),
        "relative_error_vs_float64": errors,
        "start_up_settings": start_up,
        "machine": environment(),
    }
    write_result(out, report)
    for part in ("loss_alone", "training_step"):
        r = report[part]
        print(
            f"{part:14s} today {r['today_over_before']:.3f}x the speed of {args.before}'s "
            f"(paired {r['today_over_before_paired']:.3f}x)"
        )
    for name, e in errors.items():
        print(
            f"{name:24s} relative error vs float64: loss {e['loss']:.1e}, d hidden {e['grad_hidden']:.1e}, "
            f"d weight {e['grad_weight']:.1e}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
