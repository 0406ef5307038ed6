"""The attention op and the attention module, timed side by side.

For every sequence length, dtype, causal flag and pass (forward, or forward+backward) one
interleaved run times:

* ``qkv_reference``: qkv's eager reference (``use_backend("reference")``: matmul, masked softmax,
  matmul; the spec every fast path is tested against);
* ``qkv_fast``: ``qkv.scaled_dot_product_attention`` as users call it (the fast path);
* ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors;
* ``qkv_mha`` / ``torch_mha``: ``qkv.MultiHeadAttention`` and ``torch.nn.MultiheadAttention``
  (self-attention, ``e = heads * d_h``, projections included);
* ``qkv_mha_weights`` / ``torch_mha_weights``: the same modules with ``need_weights=True``
  (per-head weights), the cost of asking for the weights (up to ``weights_max_len``).

Shape legend: ``b`` batch, ``h`` heads, ``s`` sequence length, ``d_h`` head size, ``e`` = h * d_h.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from qkv.attention import MultiHeadAttention, scaled_dot_product_attention, use_backend
from qkv.bench.timing import Timing, available_memory_bytes, paired_ratio, ratio, time_interleaved
from qkv.runtime.precision import slow_bf16_reason

logger = logging.getLogger(__name__)

# what one contender's forward call returns: the output, or (output, weights) with need_weights
Forward: TypeAlias = Callable[[], "Tensor | tuple[Tensor, Tensor]"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OP_CONTENDERS = ("qkv_reference", "qkv_fast", "torch_sdpa")
FUSED_CONTENDERS = ("qkv_fast", "torch_sdpa")  # the fused kernels: fp32 math inside, fine with emulated bf16
MODULE_CONTENDERS = ("qkv_mha", "torch_mha")
WEIGHT_CONTENDERS = ("qkv_mha_weights", "torch_mha_weights")
ALL_CONTENDERS = OP_CONTENDERS + MODULE_CONTENDERS + WEIGHT_CONTENDERS
# contenders that build (b, h, s, s) matrices: how many fp32-sized copies they hold at the peak
# (forward, forward+backward), measured at s=2048 with a margin
_QUADRATIC = {
    "qkv_reference": (4.5, 5),
    "qkv_mha_weights": (4.5, 5),
    "torch_mha_weights": (3, 4),
    "torch_mha": (3, 0.5),  # nn.MultiheadAttention's no-grad fast path with a mask materialises scores
}


def _bool_causal(s: int, device: torch.device) -> Tensor:
    """torch.nn.MultiheadAttention's convention: True = may NOT attend."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)  # (s, s)


def _op_call(name: str, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    if name == "qkv_reference":

        def call() -> Tensor:
            with use_backend("reference"):
                return scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call
    if name == "qkv_fast":
        return lambda: scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "torch_sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    raise ValueError(f"unknown attention op contender {name!r}")


def _module_call(name: str, module: nn.Module, x: Tensor, causal: bool, mask: Tensor | None) -> Forward:
    weights = name.endswith("_weights")
    if name.startswith("qkv_mha"):

        def call() -> Tensor | tuple[Tensor, Tensor]:
            out = module(x, is_causal=causal, need_weights=weights)
            return (out.output, out.weights) if weights else out.output

        return call

    def call_torch() -> Tensor | tuple[Tensor, Tensor]:
        out, attn = module(x, x, x, attn_mask=mask, is_causal=causal, need_weights=weights, average_attn_weights=False)
        return (out, attn) if weights else out

    return call_torch


def _with_backward(forward: Forward, leaves: Sequence[Tensor], grad_out: Tensor) -> Callable[[], None]:
    """forward, then backward of ``<output, grad_out>``; gradients are dropped after each call."""

    def call() -> None:
        result = forward()
        out = result[0] if isinstance(result, tuple) else result
        out.backward(grad_out)
        for leaf in leaves:
            leaf.grad = None

    return call


def _no_grad(forward: Forward) -> Forward:
    def call() -> Tensor | tuple[Tensor, Tensor]:
        with torch.no_grad():
            return forward()

    return call


def _build_modules(embed_dim: int, heads: int, dtype: torch.dtype, device: torch.device) -> dict[str, nn.Module]:
    qkv_mha = MultiHeadAttention(embed_dim, heads).to(device=device, dtype=dtype).eval()
    torch_mha = nn.MultiheadAttention(embed_dim, heads, batch_first=True).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # the same weights, so both compute the same thing
        torch_mha.in_proj_weight.copy_(torch.cat([qkv_mha.q_proj.weight, qkv_mha.k_proj.weight, qkv_mha.v_proj.weight]))
        torch_mha.in_proj_bias.copy_(torch.cat([qkv_mha.q_proj.bias, qkv_mha.k_proj.bias, qkv_mha.v_proj.bias]))
        torch_mha.out_proj.weight.copy_(qkv_mha.out_proj.weight)
        torch_mha.out_proj.bias.copy_(qkv_mha.out_proj.bias)
    return {"qkv": qkv_mha, "torch": torch_mha}


def _fits(
    name: str, batch: int, heads: int, s: int, dtype: torch.dtype, backward: bool, device: torch.device
) -> str | None:
    """Why a quadratic-memory contender is skipped (None when it should fit in free memory)."""
    if name not in _QUADRATIC:
        return None
    copies = _QUADRATIC[name][1 if backward else 0]
    need = copies * batch * heads * s * s * 4  # the softmax runs in fp32
    free = available_memory_bytes(device)
    if free is not None and need > 0.8 * free:
        return f"skipped: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return None


def attention_benchmark(
    *,
    seq_lens: Sequence[int] = (128, 512, 2048, 8192),
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    causal: Sequence[bool] = (False, True),
    passes: Sequence[str] = ("forward", "forward_backward"),
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    device: torch.device,
    repeats: int = 7,
    warmup: int = 2,
    budget_s: float | None = 60.0,
    weights_max_len: int = 2048,
    memory: bool = True,
    min_sample_s: float = 0.05,
    progress: bool = True,
    contenders: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Time attention contenders side by side over a grid of sizes.

    Args:
        seq_lens: sequence lengths ``s`` (self-attention, ``s_q = s_k = s``).
        dtypes: names in :data:`DTYPES`.
        causal: causal flags to run.
        passes: ``"forward"`` (under ``torch.no_grad``) and/or ``"forward_backward"``.
        batch, heads, head_dim: ``b``, ``h``, ``d_h``.
        device: where to run.
        repeats, warmup, budget_s: see :func:`qkv.bench.timing.time_interleaved`; sizes of 4096 and
            more use at most 3 repeats and 1 warm-up.
        weights_max_len: longest ``s`` for the ``need_weights=True`` module contenders.
        memory: measure each contender's peak memory.
        min_sample_s: shortest timed sample (short calls are repeated inside one sample).
        progress: show a progress bar.
        contenders: time only these (names above; default all), e.g. ``("qkv_fast", "torch_sdpa")``.

    Returns:
        ``{"config": ..., "results": [one entry per grid point with per-contender timings,
        peak memory and ratios]}``.
    """
    _check_grid(seq_lens, dtypes, passes, batch=batch, heads=heads, head_dim=head_dim, contenders=contenders)
    grid = [(s, d, c, p) for s in seq_lens for d in dtypes for c in causal for p in passes]
    slow_bf16 = slow_bf16_reason(device)  # without bf16 matrix units only FUSED_CONTENDERS run in bf16
    results = []
    for s, dtype_name, is_causal, pass_name in tqdm(grid, desc="attention", disable=not progress):
        results.append(
            _one_point(
                s,
                DTYPES[dtype_name],
                is_causal,
                pass_name == "forward_backward",
                batch=batch,
                heads=heads,
                head_dim=head_dim,
                device=device,
                repeats=repeats if s < 4096 else min(repeats, 3),
                warmup=warmup if s < 4096 else min(warmup, 1),
                budget_s=budget_s,
                with_weights=s <= weights_max_len,
                memory=memory,
                min_sample_s=min_sample_s,
                slow_bf16=slow_bf16,
                only=contenders,
            )
        )
    config = dict(
        seq_lens=list(seq_lens),
        dtypes=list(dtypes),
        causal=list(causal),
        passes=list(passes),
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        device=str(device),
        repeats=repeats,
        warmup=warmup,
        slow_bf16=slow_bf16,
        contenders=list(contenders or ALL_CONTENDERS),
    )
    return {"config": config, "results": results}


def _check_grid(
    seq_lens: Sequence[int],
    dtypes: Sequence[str],
    passes: Sequence[str],
    *,
    batch: int,
    heads: int,
    head_dim: int,
    contenders: Sequence[str] | None,
) -> None:
    """Raise ValueError naming the first unknown dtype, pass or contender, or a size below 1."""
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    for name in passes:
        if name not in ("forward", "forward_backward"):
            raise ValueError(f"unknown pass {name!r}; choose 'forward' or 'forward_backward'")
    if min(seq_lens) < 1 or batch < 1 or heads < 1 or head_dim < 1:
        raise ValueError(f"sizes must be positive: seq_lens={list(seq_lens)}, b={batch}, h={heads}, d_h={head_dim}")
    unknown = [name for name in contenders or () if name not in ALL_CONTENDERS]
    if unknown:
        raise ValueError(f"unknown attention contenders {unknown}; choose from {list(ALL_CONTENDERS)}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _log_point(point: dict[str, Any]) -> None:
    """One line per grid point: its size and the two ratios the targets are about."""
    logger.info(
        "s=%d %s causal=%s %s: qkv_fast/torch_sdpa %s, qkv_reference/qkv_fast %s",
        point["seq_len"],
        point["dtype"],
        point["causal"],
        point["pass"],
        _fmt(point["ratios"].get("qkv_fast_vs_torch_sdpa")),
        _fmt(point["ratios"].get("reference_vs_qkv_fast")),
    )


def _one_point(
    s: int,
    dtype: torch.dtype,
    is_causal: bool,
    backward: bool,
    *,
    batch: int,
    heads: int,
    head_dim: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    budget_s: float | None,
    with_weights: bool,
    memory: bool,
    min_sample_s: float,
    slow_bf16: str | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    q, k, v = (torch.randn(batch, heads, s, head_dim, device=device, dtype=dtype) for _ in range(3))  # (b, h, s, d_h)
    x = torch.randn(batch, s, heads * head_dim, device=device, dtype=dtype)  # (b, s, e)
    modules = _build_modules(heads * head_dim, heads, dtype, device)
    mask = _bool_causal(s, device) if is_causal else None
    names = list(OP_CONTENDERS) + list(MODULE_CONTENDERS) + (list(WEIGHT_CONTENDERS) if with_weights else [])
    if only:
        names = [name for name in names if name in only]
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)
    contenders: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        reason = _fits(name, batch, heads, s, dtype, backward, device)
        if slow_bf16 and dtype == torch.bfloat16 and name not in FUSED_CONTENDERS:
            reason = f"skipped: {slow_bf16}"
        if reason:
            skipped[name] = reason
            continue
        leaves: tuple[Tensor, ...]
        if name in OP_CONTENDERS:
            forward, leaves, grad_out = _op_call(name, q, k, v, is_causal), (q, k, v), torch.randn_like(q)
        else:
            module = modules["qkv" if name.startswith("qkv") else "torch"]
            forward, leaves, grad_out = _module_call(name, module, x, is_causal, mask), tuple(module.parameters()), x
        contenders[name] = _with_backward(forward, leaves, grad_out) if backward else _no_grad(forward)
    timings = (
        time_interleaved(
            contenders,
            device=device,
            repeats=repeats,
            warmup=warmup,
            budget_s=budget_s,
            memory=memory,
            min_sample_s=min_sample_s,
            settle=True,
        )
        if contenders
        else {}
    )
    entry = {
        "seq_len": s,
        "dtype": str(dtype).replace("torch.", ""),
        "causal": is_causal,
        "pass": "forward_backward" if backward else "forward",
        "timings": {name: t.as_dict() for name, t in timings.items()},
        "skipped": skipped,
    }
    entry["ratios"] = _point_ratios(timings)
    _log_point(entry)
    return entry


def _point_ratios(timings: dict[str, Timing]) -> dict[str, float | None]:
    """The ratios of one grid point's medians (and peaks) that the targets are about."""
    med = {name: t.median for name, t in timings.items()}
    peak = {name: t.peak_bytes for name, t in timings.items()}
    return {
        "qkv_fast_vs_torch_sdpa": ratio(med.get("qkv_fast"), med.get("torch_sdpa")),  # target <= 1.05
        "qkv_fast_vs_torch_sdpa_paired": paired_ratio(timings["qkv_fast"].times, timings["torch_sdpa"].times)
        if "qkv_fast" in timings and "torch_sdpa" in timings
        else None,
        "reference_vs_qkv_fast": ratio(med.get("qkv_reference"), med.get("qkv_fast")),  # target >= 3 at s=2048
        "qkv_mha_vs_torch_mha": ratio(med.get("qkv_mha"), med.get("torch_mha")),
        "qkv_need_weights_cost": ratio(med.get("qkv_mha_weights"), med.get("qkv_mha")),
        "torch_need_weights_cost": ratio(med.get("torch_mha_weights"), med.get("torch_mha")),
        "peak_qkv_fast_vs_reference": ratio(peak.get("qkv_fast"), peak.get("qkv_reference")),  # target <= 0.25
    }


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per grid point: times in ms, the ratios, peak memory in MiB."""
    rows = []
    for point in report["results"]:
        row = {key: point[key] for key in ("seq_len", "dtype", "causal", "pass")}
        for name, timing in point["timings"].items():
            row[f"{name}_ms"] = None if timing["median_s"] is None else round(timing["median_s"] * 1e3, 3)
            if timing["peak_bytes"] is not None:
                row[f"{name}_peak_mib"] = round(timing["peak_bytes"] / 2**20, 1)
        row.update({k: None if v is None else round(v, 3) for k, v in point["ratios"].items()})
        rows.append(row)
    return rows


def plot_attention(report: dict[str, Any], path: str | Path) -> None:
    """Time per call against ``s`` for every contender, one panel per dtype/causal/pass."""
    from qkv.bench.plots import line_panels

    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for point in report["results"]:
        title = f"{point['dtype']}, {'causal' if point['causal'] else 'full'}, {point['pass'].replace('_', '+')}"
        for name, timing in point["timings"].items():
            if timing["median_s"] is not None:
                panels.setdefault(title, {}).setdefault(name, []).append((point["seq_len"], timing["median_s"] * 1e3))
    line_panels(
        panels,
        path,
        xlabel="sequence length s",
        ylabel="ms per call",
        log=True,
        title="attention: time per call (lower is better)",
    )
