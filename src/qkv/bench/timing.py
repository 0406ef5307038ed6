"""Side-by-side timing: interleaved repeats after warm-up, medians, ratios, peak memory, JSON.

Every benchmark in :mod:`qkv.bench` times its contenders *in one run, interleaved*: repeat ``r``
runs contender A, then B, then C, ... (the order rotates each repeat), so that load from other
processes on a shared machine hits every contender alike. Figures are medians over repeats and the
report is a ratio of medians; absolute times on a noisy machine mean little.

Peak memory is measured per call: on CUDA with ``torch.cuda.max_memory_allocated``; on a Linux CPU
by resetting the process's resident-set high-water mark (``/proc/self/clear_refs``) and reading
``VmHWM`` afterwards, which counts what the call allocated above what was live before it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkv.runtime.device import pick_device  # noqa: F401  (re-exported: qkv.bench.pick_device, qkv bench)
from qkv.runtime.machine import cpu_flags, cpuinfo_fields, environment, memory_gib  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (CUDA is asynchronous; a timer must not stop before the work does)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call of one contender over interleaved repeats."""

    name: str
    times: list[float] = field(default_factory=list)
    error: str | None = None  # why it could not run (e.g. out of memory), if it could not
    peak_bytes: int | None = None  # memory allocated at the peak of one call, when measured

    @property
    def median(self) -> float | None:
        """The median of the timed rounds in seconds, or None when none ran."""
        return statistics.median(self.times) if self.times else None

    def as_dict(self) -> dict:
        """The timing as a JSON-ready dict (median, every round, peak memory, error)."""
        return {"median_s": self.median, "times_s": self.times, "peak_bytes": self.peak_bytes, "error": self.error}


def time_interleaved(
    contenders: Mapping[str, Callable[[], object]],
    *,
    device: torch.device,
    repeats: int = 7,
    warmup: int = 2,
    inner: int = 1,
    budget_s: float | None = None,
    memory: bool = False,
    min_sample_s: float = 0.0,
    settle: bool = False,
) -> dict[str, Timing]:
    """Time several callables side by side.

    Args:
        contenders: name -> zero-argument callable doing one unit of work.
        device: where the work runs (CUDA calls are synchronised around each timing).
        repeats: timed rounds; each round calls every contender (order rotated every round).
        warmup: untimed calls of each contender first (allocator, kernels, lazy init).
        inner: calls per timed sample (the sample is their mean), for very short calls.
        budget_s: stop adding rounds once this many seconds have passed (at least 3 rounds run,
            or all of them if fewer were asked), to keep very large sizes bounded.
        memory: measure each contender's peak memory (:func:`peak_memory_bytes`) on its last
            warm-up call (one extra untimed call when ``warmup`` is 0).
        min_sample_s: raise a contender's ``inner`` until one timed sample lasts about this long
            (measured on one extra call after warm-up), so that microsecond calls are not lost in
            timer and scheduler noise.
        settle: before each timed single call (``inner`` 1: long calls), make one untimed call
            of the same contender, so that the timed call follows an identical one and not
            whatever the previous contender left behind (freed gigabytes, cold caches). Without
            it, a contender that always follows a memory-hungry one in the rotation pays for it.

    Returns:
        name -> :class:`Timing`; a contender that raised (e.g. out of memory) has ``error`` set and
        is dropped from later rounds.
    """
    if repeats < 1 or warmup < 0 or inner < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, inner >= 1; got {repeats}, {warmup}, {inner}")
    if not contenders:
        raise ValueError("no contenders to time")
    results = {name: Timing(name) for name in contenders}
    _warm_up(contenders, results, device=device, warmup=warmup, memory=memory)
    inners = dict.fromkeys(contenders, inner)
    if min_sample_s > 0:
        _calibrate_inners(contenders, results, inners, device=device, min_sample_s=min_sample_s)
    names = list(contenders)
    start = time.perf_counter()
    for round_index in range(repeats):
        shift = round_index % len(names)  # each round starts one contender later
        for name in names[shift:] + names[:shift]:
            if results[name].error is None:
                _time_sample(contenders[name], results[name], device=device, inner=inners[name], settle=settle)
        if budget_s is not None and round_index + 1 >= min(3, repeats) and time.perf_counter() - start > budget_s:
            break
    return results


def _warm_up(
    contenders: Mapping[str, Callable[[], object]],
    results: dict[str, Timing],
    *,
    device: torch.device,
    warmup: int,
    memory: bool,
) -> None:
    """``warmup`` untimed calls of each contender, the last of them measuring peak memory when
    ``memory``; a contender that raises gets its ``error`` set."""
    for name, fn in contenders.items():
        try:
            for _ in range(warmup - 1 if memory and warmup else warmup):
                fn()
            synchronize(device)
            if memory:
                results[name].peak_bytes = peak_memory_bytes(fn, device)
        except (RuntimeError, MemoryError) as err:  # out of memory, unsupported dtype, ...
            results[name].error = _describe(err)
            logger.warning("%s failed in warm-up: %s", name, results[name].error)


def _calibrate_inners(
    contenders: Mapping[str, Callable[[], object]],
    results: dict[str, Timing],
    inners: dict[str, int],
    *,
    device: torch.device,
    min_sample_s: float,
) -> None:
    """Raise each contender's calls per sample until one sample lasts about ``min_sample_s``,
    judged from one extra call (at most 1000 calls per sample)."""
    for name, fn in contenders.items():
        if results[name].error is not None:
            continue
        try:
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            once = time.perf_counter() - t0
        except (RuntimeError, MemoryError) as err:
            results[name].error = _describe(err)
            continue
        inners[name] = max(inners[name], min(1000, math.ceil(min_sample_s / max(once, 1e-7))))


def _time_sample(fn: Callable[[], object], timing: Timing, *, device: torch.device, inner: int, settle: bool) -> None:
    """Append one timed sample (the mean of ``inner`` calls) to ``timing``, or set its ``error``."""
    try:
        if settle and inner == 1:
            fn()
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        timing.times.append((time.perf_counter() - t0) / inner)
    except (RuntimeError, MemoryError) as err:
        timing.error = _describe(err)
        logger.warning("%s failed: %s", timing.name, timing.error)


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines() or [""]
    return f"{type(err).__name__}: {lines[0][:200]}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def paired_ratio(numerator_times: list[float], denominator_times: list[float]) -> float | None:
    """Median over rounds of ``numerator_times[r] / denominator_times[r]``: robust to load that
    changes between rounds, since both calls of a round ran back to back on the same input."""
    pairs = [a / b for a, b in zip(numerator_times, denominator_times) if b > 0]
    return statistics.median(pairs) if pairs else None


def _proc_status_bytes(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, flags=re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _release_free_heap() -> None:
    """Hand memory that was freed but kept by glibc's allocator back to the system, so that a
    call reusing it shows up in the resident-set high-water mark (no-op off glibc)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Memory a call allocates at its peak above what was live before it, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the call. Linux CPU:
    the resident-set high-water mark (reset through ``/proc/self/clear_refs``) minus the resident
    set before the call, after ``malloc_trim`` has returned freed heap pages (so reused memory is
    counted); small calls read a few MiB of allocator noise. None where neither is available. The
    call's result is dropped afterwards.
    """
    # no gc.collect(): tensors are freed by reference counting, and a full collection costs
    # ~0.3 s in a process that has imported torch's compiler stack
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return peak
    _release_free_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    resident = _proc_status_bytes("VmRSS")
    result = fn()
    high_water = _proc_status_bytes("VmHWM")
    del result
    if resident is None or high_water is None:
        return None
    return max(high_water - resident, 0)


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations: CUDA's free memory, or Linux's ``MemAvailable``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), flags=re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None
