"""Training throughput, side by side: qkv's Transformer, ``torch.nn.Transformer`` and Hugging
Face's MarianMT with the same sizes, on the same batches, with the same loss and optimiser.

One training step is qkv's own, :meth:`qkv.training.Trainer.step`, for every contender: zero the
gradients, forward (under bfloat16 autocast for ``+bf16`` contenders), label-smoothed
cross-entropy summed over real target tokens divided by their count, backward, gradient clipping
at 1.0, the paper's schedule and Adam. Only the loss call differs: qkv computes it as its trainer
does, with ``Transformer.loss`` (the output projection fused with the loss, :mod:`qkv.nn.loss`); the
others from their logits with the same label-smoothed cross-entropy. ``+compile`` compiles the
loss call (for qkv the encoder and decoder; for the others forward and loss). Round ``r`` of the interleaved timing
gives every contender the same batch, so tokens/s are comparable; a contender's figure is target
tokens trained divided by the seconds its timed steps took.

Contender names: ``qkv``, ``torch`` (``nn.Transformer``), ``marian``; suffix ``+bf16`` for bfloat16
autocast and ``+compile`` for ``torch.compile`` (qkv only by default).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.bench.competitors import TorchTransformerMT, build_marian, count_parameters
from qkv.bench.data import BenchData
from qkv.bench.timing import paired_ratio, ratio, time_interleaved
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import label_smoothed_cross_entropy
from qkv.training import TrainConfig, Trainer
from qkv.training.objectives import Objective, cross_entropy_smoothing
from qkv.training.tasks import TranslationTask, translation_loss

logger = logging.getLogger(__name__)

FAMILIES = ("qkv", "torch", "marian")


def multi30k_config(data: BenchData, **overrides: Any) -> TransformerConfig:
    """The Multi30k model of the translation benchmark: d_model 256, 4 heads, 3+3 layers, d_ff 1024,
    shared embeddings and tied output over the joint vocabulary; ``overrides`` replace fields."""
    fields: dict[str, Any] = dict(
        src_vocab_size=data.vocab_size,
        tgt_vocab_size=data.vocab_size,
        d_model=256,
        num_heads=4,
        num_encoder_layers=3,
        num_decoder_layers=3,
        d_ff=1024,
        dropout=0.1,
        max_len=512,
        share_embeddings=True,
        tie_output=True,
        pad_id=data.pad_id,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_model(family: str, config: TransformerConfig, data: BenchData) -> nn.Module:
    """A model of ``family`` (``qkv``, ``torch`` or ``marian``) with ``config``'s sizes, called as
    ``model(src, tgt_in) -> logits``."""
    if family == "qkv":
        return Transformer(config)
    if family == "torch":
        return TorchTransformerMT(config)
    if family == "marian":
        return build_marian(config, bos_id=data.bos_id, eos_id=data.eos_id)
    raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")


def parse_contender(name: str) -> tuple[str, bool, bool]:
    """``"qkv+bf16+compile"`` -> ``("qkv", bf16=True, compile=True)``."""
    family, *flags = name.split("+")
    unknown = [f for f in flags if f not in ("bf16", "compile")]
    if family not in FAMILIES or unknown:
        raise ValueError(f"bad contender {name!r}: a family in {FAMILIES} and optional +bf16 / +compile")
    return family, "bf16" in flags, "compile" in flags


class _ContenderTask:
    """The loss call of one contender, for :meth:`Trainer.step` (the rest of the step is shared)."""

    loss = staticmethod(TranslationTask.loss)

    def __init__(self, model: nn.Module, pad_id: int) -> None:
        if isinstance(model, Transformer):
            self.loss_fn = translation_loss
        else:
            self.loss_fn = functools.partial(_loss_from_logits, pad_id=pad_id)


def _loss_from_logits(
    model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, *, objective: Objective, pad_id: int
) -> Tensor:
    """Label-smoothed cross-entropy from ``model``'s logits, with ``objective``'s smoothing: the one
    objective the contenders other than qkv's Transformer have."""
    logits = model(src, tgt_in)  # (b, s_tgt, V)
    return label_smoothed_cross_entropy(logits, tgt_out, cross_entropy_smoothing(objective), pad_id)


def make_train_step(
    model: nn.Module,
    data: BenchData,
    *,
    device: torch.device,
    bf16: bool = False,
    compile_model: bool = False,
    label_smoothing: float = 0.1,
    d_model: int = 256,
) -> Callable[[], int]:
    """A zero-argument training step (:meth:`qkv.training.Trainer.step`) over ``data.batches`` in
    order (cycling). Returns the step's target token count."""
    config = TrainConfig(bf16=bf16, compile=compile_model, label_smoothing=label_smoothing, progress=False)
    step_only: Any = _ContenderTask(model, data.pad_id)  # what Trainer.step uses of a Task, no more
    trainer = Trainer(model.to(device), step_only, config, d_model=d_model)
    position = [0]

    def step() -> int:
        batch = data.batches[position[0] % len(data.batches)]
        position[0] += 1
        return trainer.step([batch]).tokens

    return step


def training_benchmark(
    data: BenchData,
    config: TransformerConfig,
    *,
    contenders: Sequence[str] = ("qkv", "torch", "marian", "qkv+bf16", "torch+bf16", "marian+bf16"),
    device: torch.device,
    repeats: int = 8,
    warmup: int = 2,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Tokens/s of each contender's training step, timed interleaved on the same batches.

    Args:
        data: the batches (moved to ``device`` here).
        config: the model sizes, shared by every family.
        contenders: names as parsed by :func:`parse_contender`.
        device: where to train.
        repeats: timed steps per contender; warmup: untimed steps first (compilation happens there).
        budget_s: stop adding rounds after this many seconds (at least 3 rounds).

    Returns:
        ``{"config", "data", "contenders": {name: {tokens_per_s, median_step_s, ...}}, "ratios"}``.
    """
    if not contenders:
        raise ValueError("no contenders given")
    parsed = {name: parse_contender(name) for name in contenders}
    data = data.to(device)
    steps: dict[str, Callable[[], int]] = {}
    parameters: dict[str, int] = {}
    for name, (family, bf16, compile_model) in parsed.items():
        try:
            model = build_model(family, config, data)
        except (ImportError, ValueError) as err:
            logger.warning("%s left out: %s", name, err)
            continue
        parameters[name] = count_parameters(model)
        steps[name] = make_train_step(
            model, data, device=device, bf16=bf16, compile_model=compile_model, d_model=config.d_model
        )
    timings = time_interleaved(steps, device=device, repeats=repeats, warmup=warmup, budget_s=budget_s)
    # every contender consumed the same batches: `warmup` untimed, then one per timed round
    tokens = [b.num_tgt_tokens for b in data.batches]
    results: dict[str, dict[str, Any]] = {}
    tps: dict[str, float | None] = {}
    for name, timing in timings.items():
        timed_tokens = sum(tokens[(warmup + i) % len(tokens)] for i in range(len(timing.times)))
        seconds = sum(timing.times)
        tps[name] = timed_tokens / seconds if seconds else None
        results[name] = {
            "tokens_per_s": tps[name],
            "median_step_s": timing.median,
            "steps_timed": len(timing.times),
            "parameters": parameters[name],
            "times_s": timing.times,
            "error": timing.error,
        }
    pairs = []  # (faster candidate, baseline)
    for suffix in ("", "+bf16"):
        pairs += [(f"qkv{suffix}", f"{other}{suffix}") for other in ("torch", "marian")]
    pairs += [(name, parsed[name][0]) for name in tps if parsed[name][1] or parsed[name][2]]
    ratios: dict[str, float | None] = {}
    paired: dict[str, float | None] = {}
    for name, base in pairs:
        if name in tps and base in tps:
            ratios[f"{name}_vs_{base}"] = ratio(tps[name], tps[base])
            paired[f"{name}_vs_{base}"] = paired_ratio(timings[base].times, timings[name].times)
    return {
        "config": {"model": _config_dict(config), "device": str(device), "repeats": repeats, "warmup": warmup},
        "data": {"description": data.description, **data.info},
        "contenders": results,
        "ratios": ratios,  # tokens/s over all timed steps
        "paired_ratios": paired,  # median over rounds of the per-round (same batch) ratio
    }


def _config_dict(config: TransformerConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)


def plot_training(report: dict[str, Any], path: str | Path) -> None:
    """Bars of target tokens/s per contender."""
    from qkv.bench.plots import bar_chart

    values = {n: r["tokens_per_s"] for n, r in report["contenders"].items() if r["tokens_per_s"]}
    bar_chart(
        values,
        path,
        ylabel="target tokens / s (higher is better)",
        title=f"training step, {report['data']['description']}",
    )
