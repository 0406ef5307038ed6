"""Training on one process or several: the Multi30k model's training tokens/s on this machine's
cores, 1 process x 1 thread, 1 process x 2 threads and 2 processes x 1 thread (gloo), each step
the same two Multi30k batches (one process accumulates both, two processes take one each), run
in alternating rounds; and a projection, from floating-point operations counted per step, of
what the paper's base and big models cost on N GPUs.

    python benchmarks/studies/distributed.py      # writes benchmarks/results/distributed/distributed.json

Every step is :meth:`qkv.training.Trainer.step`, as in ``qkv train``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkv.training.tasks import TranslationTask, translation_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

# Peak dense bf16 tensor throughput per GPU (vendor data sheets), and the utilisation assumed.
GPUS = {"A100 (312 TFLOP/s bf16)": 312e12, "H100 SXM (989 TFLOP/s bf16)": 989e12}
UTILISATION = 0.4
# The paper's models (Table 3) and their training (section 5.2): ~25k source + ~25k target tokens a step.
PAPER = {
    "base": dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6, d_ff=2048, steps=100_000),
    "big": dict(d_model=1024, num_heads=16, num_encoder_layers=6, num_decoder_layers=6, d_ff=4096, steps=300_000),
}


def _worker(ctx, out: str, batches_path: str, mode: str, steps: int, warmup: int, threads: int) -> None:
    from qkv.bench.data import BenchData
    from qkv.bench.training import multi30k_config
    from qkv.data.batching import Batch
    from qkv.models.transformer import Transformer
    from qkv.training import TrainConfig, Trainer

    torch.set_num_threads(threads)
    saved = torch.load(batches_path, weights_only=True)  # tensors and numbers only: no pickled objects
    data = BenchData(
        [Batch(*fields) for fields in saved["batches"]],
        [],
        saved["vocab_size"],
        saved["pad_id"],
        saved["bos_id"],
        saved["eos_id"],
        "",
    )
    torch.manual_seed(0)
    model = Transformer(multi30k_config(data))
    trainer = Trainer(model, _Task(), TrainConfig(progress=False), dist=ctx)
    batches, world = data.batches, ctx.world_size
    per_step = 2 // world
    times, tokens = [], []
    for k in range(warmup + steps):
        mine = [batches[(2 * k + ctx.rank * per_step + j) % len(batches)] for j in range(per_step)]
        ctx.barrier()
        start = time.perf_counter()
        stats = trainer.step(mine)
        ctx.barrier()
        if k >= warmup:
            times.append(time.perf_counter() - start)
            tokens.append(stats.tokens)
    if ctx.is_main:
        torch.save({"times": times, "tokens": tokens}, Path(out, f"{mode}.pt"))


class _Task:
    """Trainer.step needs only the loss call."""

    loss_fn = staticmethod(translation_loss)
    loss = staticmethod(TranslationTask.loss)


def _alone(out: str, batches_path: str, mode: str, steps: int, warmup: int, threads: int) -> None:
    from qkv.training.distributed import Distributed

    _worker(Distributed(), out, batches_path, mode, steps, warmup, threads)


def measure(mode: str, out: Path, batches_path: Path, steps: int, warmup: int) -> dict:
    import subprocess

    import dist_workers

    if mode == "2x1":
        dist_workers.launch(_worker, (str(out), str(batches_path), mode, steps, warmup, 1), timeout=1800)
    else:
        threads = int(mode.split("x")[1])
        here = str(Path(__file__).parent)
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import distributed as d; "
            f"d._alone({str(out)!r}, {str(batches_path)!r}, {mode!r}, {steps:d}, {warmup:d}, {threads:d})"
        )
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).resolve().parents[2] / "tests"), os.environ.get("PYTHONPATH", "")]
                ),
            },
        )
    result = torch.load(out / f"{mode}.pt", weights_only=True)
    return {
        "tokens_per_s": sum(result["tokens"]) / sum(result["times"]),
        "step_s": result["times"],
        "tokens": sum(result["tokens"]),
    }


def projection() -> dict:
    """Floating-point operations of one training step (forward + backward) of the paper's models,
    counted by torch's FlopCounterMode on a few sentences and scaled to the step's 1,000 (every
    operation's count grows linearly with the sentences at a fixed length), and what a step and
    the paper's schedule cost on N GPUs at UTILISATION of their peak: a projection."""
    from torch.utils.flop_counter import FlopCounterMode

    from qkv.models.transformer import Transformer, TransformerConfig

    rows = {}
    sentences, length = 1000, 25  # ~25k source and ~25k target tokens a step (section 5.2)
    for name, sizes in PAPER.items():
        sizes = dict(sizes)
        total_steps = sizes.pop("steps")
        config = TransformerConfig(
            src_vocab_size=37000, tgt_vocab_size=37000, share_embeddings=True, dropout=0.0, max_len=256, **sizes
        )
        model = Transformer(config)
        counted = 4
        src = torch.randint(4, 37000, (counted, length))
        tgt = torch.randint(4, 37000, (counted, length))
        counter = FlopCounterMode(display=False)
        with counter:
            model.loss(src, tgt, tgt).backward()
        flops = counter.get_total_flops() * sentences // counted
        per_gpu = {}
        for gpu, peak in GPUS.items():
            per_gpu[gpu] = {
                str(n): {
                    "seconds_per_step": flops / (n * peak * UTILISATION),
                    "hours_for_schedule": flops * total_steps / (n * peak * UTILISATION) / 3600,
                }
                for n in (1, 8, 64)
            }
        rows[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "flops_per_step": flops,
            "tokens_per_step": 2 * sentences * length,
            "schedule_steps": total_steps,
            "gpus": per_gpu,
        }
    return {
        "assumptions": f"{UTILISATION:.0%} of peak bf16 throughput, no communication cost; a projection, "
        "not a measurement",
        "models": rows,
    }


def main() -> int:
    from qkv.bench.data import multi30k_data
    from qkv.bench.provenance import write_result
    from qkv.bench.results import add_result_options, check_result_file
    from qkv.bench.timing import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round (2 batches a step)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    add_result_options(parser, "benchmarks/results/distributed/distributed.json")
    args = parser.parse_args()
    check_result_file(parser, args)  # before any work
    data = multi30k_data(args.data_dir, max_tokens=4000, num_batches=16)
    modes = ("1x1", "1x2", "2x1")
    results = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        batches_path = Path(tmp, "batches.pt")
        torch.save(
            {
                "batches": [(b.src, b.tgt_in, b.tgt_out, b.num_tgt_tokens) for b in data.batches],
                "vocab_size": data.vocab_size,
                "pad_id": data.pad_id,
                "bos_id": data.bos_id,
                "eos_id": data.eos_id,
            },
            batches_path,
        )
        for round_ in range(args.rounds):
            for mode in modes:
                results[mode].append(measure(mode, Path(tmp), batches_path, args.steps, args.warmup))
                print(round_, mode, round(results[mode][-1]["tokens_per_s"], 1), flush=True)
    median = {m: statistics.median(r["tokens_per_s"] for r in results[m]) for m in modes}
    report = {
        "benchmark": "Multi30k model (d 256, 3+3 layers), Trainer.step on the same 2 batches a step; tokens/s",
        "command": " ".join(["python", *sys.argv]),
        "data": data.info,
        "tokens_per_s_median": median,
        "two_processes_vs_two_threads": median["2x1"] / median["1x2"],
        "scaling_efficiency_2_processes": median["2x1"] / (2 * median["1x1"]),
        "rounds": results,
        "projection": projection(),
        "machine": {**environment(), "load_average": os.getloadavg(), "platform": platform.platform()},
    }
    write_result(args.out, report)
    print(
        {k: round(v, 1) for k, v in median.items()},
        "2x1/1x2 =",
        round(report["two_processes_vs_two_threads"], 3),
        "efficiency",
        round(report["scaling_efficiency_2_processes"], 3),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
