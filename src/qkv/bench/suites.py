"""The benchmark suites behind ``qkv bench`` and the scripts in ``benchmarks/``: each runs its
contenders side by side, writes ``<out>/<suite>.json`` (figures, ratios, environment, command)
and ``<out>/<suite>.png``, and returns a markdown summary of the ratios.

``quick=True`` shrinks every suite to a smoke run of seconds (tiny sizes, few repeats): it checks
that the machinery works, its figures mean little.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from qkv.bench.data import BenchData, multi30k_data, synthetic_data
from qkv.bench.provenance import write_result
from qkv.bench.timing import environment
from qkv.models.transformer import TransformerConfig
from qkv.runtime.precision import slow_bf16_reason

logger = logging.getLogger(__name__)

SUITES = ("attention", "training", "decoding", "precision")
TRAINING_CONTENDERS = ("qkv", "torch", "marian", "qkv+bf16", "torch+bf16", "marian+bf16")
PRECISION_CONTENDERS = ("qkv", "qkv+bf16", "qkv+compile", "qkv+bf16+compile")


def load_data(data_dir: str | Path | None, *, quick: bool) -> BenchData:
    """Multi30k batches (``data_dir`` or the usual places, see :func:`qkv.data.resolve_multi30k`);
    for a quick run without Multi30k, synthetic batches."""
    try:
        if quick:
            return multi30k_data(data_dir, vocab_size=1000, max_tokens=600, num_batches=3, train_limit=2000)
        return multi30k_data(data_dir, vocab_size=8000, max_tokens=6000, num_batches=16)
    except FileNotFoundError:
        if not quick:
            raise
        logger.warning("Multi30k not found: the quick run uses synthetic batches")
        return synthetic_data(vocab_size=300, num_batches=3, batch_size=8, src_len=12, tgt_len=12, num_sources=16)


def _model_config(data: BenchData, quick: bool) -> TransformerConfig:
    from qkv.bench.training import multi30k_config

    if quick:
        return multi30k_config(
            data, d_model=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=128, max_len=128
        )
    return multi30k_config(data)


def run_suite(
    name: str,
    *,
    out_dir: str | Path,
    device: torch.device,
    quick: bool = False,
    data_dir: str | Path | None = None,
    data: BenchData | None = None,
    progress: bool = True,
    compile_models: bool | None = None,
    attention_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """Run one suite, write its JSON and plot, return ``(report, markdown summary)``.

    Args:
        name: one of :data:`SUITES`.
        out_dir: folder for ``<name>.json`` and ``<name>.png``.
        device: where to run.
        quick: a seconds-long smoke run.
        data_dir: the Multi30k folder (model suites).
        data: batches to use instead of loading Multi30k (model suites).
        progress: progress bars.
        compile_models: time ``torch.compile`` contenders in the precision suite (default: not in
            quick runs, where compiling would take longer than everything else).
        attention_options: extra arguments of :func:`qkv.bench.attention.attention_benchmark`
            (``seq_lens``, ``dtypes``, ``passes``, ``contenders``).
    """
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {SUITES} or 'all'")
    out_dir = Path(out_dir)
    env = environment()
    plot: Callable[[dict[str, Any], Path], None]
    if name == "attention":
        from qkv.bench.attention import attention_benchmark, plot_attention

        # the options as given, checked by attention_benchmark (sizes, dtypes, passes, contenders)
        kwargs: dict[str, Any] = dict(seq_lens=(64, 128), repeats=3, warmup=1, budget_s=5.0) if quick else {}
        kwargs.update(attention_options or {})
        report = attention_benchmark(device=device, progress=progress, **kwargs)
        plot = plot_attention
    else:
        if data is None:
            data = load_data(data_dir, quick=quick)
        config = _model_config(data, quick)
        if name == "decoding":
            from qkv.bench.decoding import decoding_benchmark, plot_decoding

            if quick:
                report = decoding_benchmark(
                    data, config, device=device, batch_size=4, src_len=6, new_tokens=12, beam_size=3, repeats=2
                )
            else:
                report = decoding_benchmark(data, config, device=device)
            plot = plot_decoding
        else:
            from qkv.bench.training import plot_training

            report = _training_report(name, data, config, device=device, quick=quick, compile_models=compile_models)
            plot = plot_training
    report = {"suite": name, "quick": quick, "command": " ".join(sys.argv), "environment": env, **report}
    json_path = write_result(out_dir / f"{name}.json", report)
    png_path = out_dir / f"{name}.png"
    plot(report, png_path)
    logger.info("wrote %s and %s", json_path, png_path)
    return report, summarize(report)


def _training_report(
    name: str,
    data: BenchData,
    config: TransformerConfig,
    *,
    device: torch.device,
    quick: bool,
    compile_models: bool | None,
) -> dict[str, Any]:
    """The training or precision suite's report, with the contenders left out and why."""
    from qkv.bench.training import training_benchmark

    contenders: tuple[str, ...]
    if name == "training":
        contenders = TRAINING_CONTENDERS
    else:
        use_compile = (not quick) if compile_models is None else compile_models
        contenders = PRECISION_CONTENDERS if use_compile else PRECISION_CONTENDERS[:2]
    skipped: dict[str, str] = {}
    slow_bf16 = slow_bf16_reason(device)
    if slow_bf16:  # an emulated bf16 step takes minutes; say why instead of timing it
        skipped = {c: slow_bf16 for c in contenders if "+bf16" in c}
        contenders = tuple(c for c in contenders if c not in skipped)
    repeats, warmup = (3, 1) if quick else (8, 3)
    report = training_benchmark(data, config, contenders=contenders, device=device, repeats=repeats, warmup=warmup)
    report["skipped"] = skipped
    return report


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _mib(timings: dict[str, dict[str, Any]], name: str) -> str:
    """A contender's peak memory in MiB, or n/a where it was not measured."""
    peak = timings.get(name, {}).get("peak_bytes")
    return "n/a" if peak is None else f"{peak / 2**20:,.0f}"


def summarize(report: dict[str, Any]) -> str:
    """A markdown summary of one suite's report (the ratios that the issue's targets are about)."""
    suite = report["suite"]
    env = report["environment"]
    head = (
        f"**{suite}** on {env.get('cuda_device') or env.get('cpu_model') or env.get('machine')}, "
        f"{env.get('torch_threads')} thread{'' if env.get('torch_threads') == 1 else 's'}, "
        f"torch {env.get('torch')}, load average "
        f"{', '.join(f'{x:.1f}' for x in env.get('load_average') or [])}"
    )
    lines = [head, ""]
    if suite == "attention":
        lines += [
            "| s | dtype | causal | pass | qkv fast / torch SDPA (paired) | eager / qkv fast | qkv MHA / torch MHA "
            "| need_weights cost (qkv, torch) | peak MiB (fast, eager) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in report["results"]:
            r, t = p["ratios"], p["timings"]
            eager = _x(r["reference_vs_qkv_fast"]) if "qkv_reference" in t else p["skipped"].get("qkv_reference", "n/a")
            lines.append(
                f"| {p['seq_len']} | {p['dtype']} | {p['causal']} | {p['pass'].replace('_', '+')} "
                f"| {_x(r['qkv_fast_vs_torch_sdpa'])} ({_x(r.get('qkv_fast_vs_torch_sdpa_paired'))}) | {eager} | {_x(r['qkv_mha_vs_torch_mha'])} "
                f"| {_x(r['qkv_need_weights_cost'])}, {_x(r['torch_need_weights_cost'])} "
                f"| {_mib(t, 'qkv_fast')}, {_mib(t, 'qkv_reference')} |"
            )
    elif suite in ("training", "precision"):
        lines += ["| contender | target tokens/s | median step (s) |", "|---|---|---|"]
        for name, r in report["contenders"].items():
            tps = "failed: " + str(r["error"]) if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
            step = "n/a" if r["median_step_s"] is None else f"{r['median_step_s']:.3f}"
            lines.append(f"| {name} | {tps} | {step} |")
        lines += ["", "| ratio (tokens/s) | all timed steps | median of per-batch ratios |", "|---|---|---|"]
        paired = report.get("paired_ratios", {})
        lines += [f"| {k} | {_x(v)} | {_x(paired.get(k))} |" for k, v in report["ratios"].items()]
        lines += [f"\nnot timed: {name}: {why}" for name, why in report.get("skipped", {}).items()]
    elif suite == "decoding":
        c = report["config"]
        lines += [
            f"batch {c['batch_size']}, {c['new_tokens']} new tokens, beam {c['beam_size']}",
            "",
            "| contender | seconds per batch | generated tokens/s |",
            "|---|---|---|",
        ]
        for name, r in report["contenders"].items():
            sec = "failed: " + str(r["error"]) if r["median_s"] is None else f"{r['median_s']:.3f}"
            tps = "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
            lines.append(f"| {name} | {sec} | {tps} |")
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {_x(v)} |" for k, v in report["ratios"].items()]
    return "\n".join(lines)
