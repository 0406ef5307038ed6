"""Where one training step's time goes: ``torch.profiler`` over one step, its kernels (CUDA) or
operators (CPU) ranked by their own time and grouped into matrix products, attention, the
optimizer, memory copies and the rest.

On CUDA the time counted is the GPU's: each kernel's duration on the device. ``busy_share`` is the
share of the step's wall time the GPU spent in kernels at all; what is missing is time the GPU waited
for the CPU to launch work (launch-bound steps). On the CPU the time counted is each operator's self
time (its own, without the operators it called), and ``busy_share`` the share of the wall time
spent in operators (the rest is Python).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType

CATEGORIES = ("matmul", "attention", "optimizer", "memory", "other")
# kernel and operator names, lower-cased; the first category that matches wins
PATTERNS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|sdp_|softmax_backward_data_and_dropout")),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|triton_tem|aten::(mm|addmm|bmm|baddbmm)$")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach")),
    ("memory", re.compile(r"memcpy|memset|aten::copy_|aten::to$|aten::_to_copy|aten::fill_|aten::zero_")),
)


def category(name: str) -> str:
    """The group a kernel or operator of this name belongs to (one of :data:`CATEGORIES`)."""
    low = name.lower()
    for group, pattern in PATTERNS:
        if pattern.search(low):
            return group
    return "other"


def _device_times(prof: torch.profiler.profile, device: torch.device) -> dict[str, tuple[float, int]]:
    """Name -> (seconds of own time, calls): CUDA kernels' durations, or CPU operators' self times."""
    out: dict[str, tuple[float, int]] = {}
    if device.type == "cuda":
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                seconds, calls = out.get(event.name, (0.0, 0))
                out[event.name] = (seconds + event.time_range.elapsed_us() / 1e6, calls + 1)
        return out
    for avg in prof.key_averages():
        if avg.self_cpu_time_total > 0:
            out[avg.key] = (avg.self_cpu_time_total / 1e6, avg.count)
    return out


def profile_step(step: Callable[[], object], device: torch.device, *, top: int = 15) -> dict[str, Any]:
    """Profile one call of ``step`` (already warmed up) and summarise it.

    Returns:
        ``wall_s``, ``busy_s`` (kernel or operator time), ``busy_share``, ``shares`` (of the busy
        time, by category), ``outside_matmul_share`` (of the busy time: everything but matrix
        products) and ``top``: the ``top`` kernels or operators by own time with their share.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    times = _device_times(prof, device)
    busy = sum(seconds for seconds, _ in times.values())
    shares = dict.fromkeys(CATEGORIES, 0.0)
    for name, (seconds, _) in times.items():
        shares[category(name)] += seconds
    ranked = sorted(times.items(), key=lambda item: -item[1][0])[:top]
    fractions = {k: (v / busy if busy > 0 else 0.0) for k, v in shares.items()}
    outside = [name for name, _ in ranked if category(name) not in ("matmul", "attention")][:3]
    summary = (
        f"{fractions['matmul']:.0%} of the {'kernel' if device.type == 'cuda' else 'operator'} time in matrix "
        f"products, {fractions['attention']:.0%} in attention, {fractions['optimizer']:.0%} in the optimizer, "
        f"{fractions['memory'] + fractions['other']:.0%} elsewhere (largest: {'; '.join(n[:60] for n in outside)}); "
        f"busy {busy / wall if wall > 0 else 0:.0%} of the step's {wall * 1e3:.1f} ms"
    )
    return {
        "summary": summary,
        "counted": "CUDA kernel time" if device.type == "cuda" else "CPU operator self time",
        "wall_s": wall,
        "busy_s": busy,
        "busy_share": busy / wall if wall > 0 else None,
        "shares": fractions,
        "outside_matmul_share": 1.0 - shares["matmul"] / busy if busy > 0 else None,
        "top": [
            {
                "name": name[:160],
                "category": category(name),
                "seconds": seconds,
                "calls": calls,
                "share": seconds / busy if busy > 0 else 0.0,
            }
            for name, (seconds, calls) in ranked
        ],
    }
