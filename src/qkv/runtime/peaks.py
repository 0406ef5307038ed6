"""Peak matrix-product FLOP/s of a device, the denominator of MFU (model FLOPs utilisation).

GPUs: the vendor's dense (not 2:4-sparse) tensor-core figures, from a small table matched on
``torch.cuda.get_device_name``. float32 products run on the plain FP32 units under PyTorch's default
``torch.get_float32_matmul_precision() == "highest"`` and on TF32 tensor cores otherwise.
A GPU not in the table has no peak (MFU is then left out, never guessed).

CPUs: no datasheet figure fits (clocks, cores, threads and ISA differ from machine to machine), so the
ceiling is measured: the best rate of a square ``torch.mm`` in the dtype, on this process's threads,
timed once per machine (under 1 s) and kept as JSON in qkv's cache folder, keyed by the CPU model,
its flags, the ISA limits set in the environment, torch's version and the thread count. The cache
file is read as JSON only and checked entry by entry; one that is corrupt or not ours is ignored
(and rewritten with a fresh measurement).

Other programs on the CPUs slow the product down, and a ceiling measured then would stay wrong for
every later run: each entry records the load average it was measured under, a measurement taken
while the machine was busy (:func:`machine_busy`: load above the core count) is used for this process
only and never cached, and an entry from before loads were recorded is measured again, the better
of the two kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import torch

from qkv.runtime.fileio import default_cache_dir, write_json
from qkv.runtime.machine import cpuinfo_fields
from qkv.runtime.precision import bf16_is_fast, cpu_bf16_probe

logger = logging.getLogger(__name__)

T = 1e12
# (pattern on torch.cuda.get_device_name, name, dense FP32, dense TF32, dense BF16/FP16 FLOP/s), first match wins.
# Sources: NVIDIA's datasheets, whose tensor-core figures are "with sparsity" (dense = half of them):
# H100 Tensor Core GPU datasheet (SXM5: FP32 67, TF32 989*, BF16 1,979*; PCIe: 51, 756*, 1,513*;
# NVL: 60, 835*, 1,671*); H200 Tensor Core GPU datasheet (SXM: 67, 989*, 1,979*; NVL: 60, 835*, 1,671*);
# A100 Tensor Core GPU datasheet (FP32 19.5, TF32 156, BF16 312, dense, 40 and 80 GB, SXM and PCIe);
# L4 datasheet (FP32 30.3, TF32 120*, BF16 242*); L40S datasheet (FP32 91.6, TF32 183 | 366*,
# BF16 362.05 | 733*); A10 datasheet (FP32 31.2, TF32 62.5 | 125*, BF16 125 | 250*); NVIDIA Ada
# GPU architecture whitepaper, appendix A, GeForce RTX 4090 (FP32 82.6, TF32 82.6, BF16 with FP32
# accumulate 165.2, dense). The AWS A10G is not the A10 and has no NVIDIA datasheet: left out.
GPU_PEAKS: tuple[tuple[str, str, float, float, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 51 * T, 378 * T, 756.5 * T),
    (r"\bH100 NVL\b", "H100 NVL", 60 * T, 417.5 * T, 835.5 * T),
    (r"\bH100\b", "H100 SXM", 67 * T, 494.5 * T, 989.5 * T),
    (r"\bH200 NVL\b", "H200 NVL", 60 * T, 417.5 * T, 835.5 * T),
    (r"\bH200\b", "H200 SXM", 67 * T, 494.5 * T, 989.5 * T),
    (r"\bA100\b", "A100", 19.5 * T, 156 * T, 312 * T),
    (r"\bL4$", "L4", 30.3 * T, 60 * T, 121 * T),
    (r"\bL40S$", "L40S", 91.6 * T, 183 * T, 362.05 * T),
    (r"\bA10$", "A10", 31.2 * T, 62.5 * T, 125 * T),
    (r"\bRTX 4090$", "GeForce RTX 4090", 82.6 * T, 82.6 * T, 165.2 * T),
)
CACHE_NAME = "matmul_peaks.json"
CACHE_VERSION = 1
MAX_CACHE_BYTES = 1 << 20  # a larger file is not ours


def gpu_peak(name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """The datasheet's dense peak FLOP/s of the GPU called ``name`` in ``dtype``, and where it is from."""
    for pattern, gpu, fp32, tf32, half in GPU_PEAKS:
        if re.search(pattern, name.strip()):
            if dtype in (torch.bfloat16, torch.float16):
                return half, f"{gpu} datasheet, dense {str(dtype).removeprefix('torch.')} tensor core"
            if dtype == torch.float32:
                if torch.get_float32_matmul_precision() == "highest":
                    return fp32, f"{gpu} datasheet, FP32"
                return tf32, f"{gpu} datasheet, dense TF32 tensor core (float32 matmul precision not 'highest')"
            return None
    return None


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str] | None:
    """Peak matrix-product FLOP/s of ``device`` in ``dtype`` (the compute dtype: bfloat16 under bf16
    autocast) and where the figure comes from, or None where none is known (an unlisted GPU, another
    device type, or a dtype other than float32/bfloat16/float16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return cpu_peak(dtype, torch.get_num_threads())
    return None


# ----------------------------------------------------------------- the CPU's measured ceiling
def cache_path() -> Path:
    """This module's file in qkv's cache folder (:func:`qkv.runtime.fileio.default_cache_dir`)."""
    return default_cache_dir() / CACHE_NAME


def machine_key(dtype: torch.dtype, threads: int) -> str:
    """What a measured ceiling depends on, hashed: CPU model and flags, ISA limits, torch, threads, dtype."""
    cpu = cpuinfo_fields("model name", "flags")
    limits = [os.environ.get(n, "") for n in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]
    parts = [cpu["model name"] or "", cpu["flags"] or "", *limits, torch.__version__, str(threads), str(dtype)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _valid_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    flops, size, source = entry.get("flops"), entry.get("size"), entry.get("source")
    return (
        isinstance(flops, float)
        and math.isfinite(flops)
        and 0 < flops < 1e16
        and isinstance(size, int)
        and not isinstance(size, bool)
        and isinstance(source, str)
        and len(source) < 500
        and (entry.get("load") is None or _is_load(entry["load"]))
    )


def _is_load(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def machine_load() -> tuple[float | None, int]:
    """The machine's 1-minute load average (None where the OS does not report one) and the number of
    cores this process may run on.

    Returns:
        ``(load, cores)``.
    """
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return load, max(cores, 1)


def machine_busy(load: float | None, cores: int) -> bool:
    """Whether other work loads the CPUs: more runnable processes on average than there are cores.

    Args:
        load: a load average (None: unknown, taken as not busy).
        cores: the cores this process may run on.

    Returns:
        True when ``load`` is above ``cores``.
    """
    return load is not None and load > cores


def read_cache(path: Path) -> dict[str, dict]:
    """The valid entries of the cache file ``path``; {} where it is missing, unreadable, too large,
    not JSON or not in this module's format. Entries that fail the checks are dropped one by one."""
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("peaks"), dict):
        return {}
    return {k: v for k, v in data["peaks"].items() if isinstance(k, str) and _valid_entry(v)}


def measure_matmul(dtype: torch.dtype, *, budget_s: float = 0.4) -> tuple[float, int]:
    """The best FLOP/s of a square ``torch.mm`` in ``dtype`` on this process's threads, and the size.

    1024 x 1024 (2048 where one product takes under 10 ms), timed for about ``budget_s`` seconds.
    Where bfloat16 products are emulated (seconds each), the figure is :func:`cpu_bf16_probe`'s
    256 x 256 timing instead: that is the ceiling bf16 autocast runs against there.
    """
    if dtype == torch.bfloat16 and not bf16_is_fast("cpu"):
        return 2 * 256**3 / cpu_bf16_probe()[1], 256
    generator = torch.Generator().manual_seed(0)  # its own: measuring must not move the caller's RNG
    size = 1024
    while True:
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        torch.mm(a, b)  # warm-up
        start = time.perf_counter()
        torch.mm(a, b)
        first = time.perf_counter() - start
        if first >= 0.01 or size >= 2048:
            break
        size *= 2
    best, spent = first, first
    for _ in range(100):  # bounded however the clock behaves
        if spent >= budget_s:
            break
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * size**3 / best, size


@functools.cache
def cpu_peak(dtype: torch.dtype, threads: int) -> tuple[float, str]:
    """This CPU's measured matrix-product ceiling in ``dtype`` on ``threads`` threads (cached on disk
    per machine and in memory per process), and where it is from.

    A cached entry that records its load is used as it is; one from before loads were recorded is
    measured again and the better figure kept. A measurement taken while the machine is busy
    (:func:`machine_busy`) is returned but not cached, so a later, quieter run measures again.
    """
    path, key = cache_path(), machine_key(dtype, threads)
    entries = read_cache(path)
    old = entries.get(key)
    if old is not None and "load" in old:  # measured on a machine that was not busy
        return old["flops"], old["source"] + f" (cached in {path})"
    load, cores = machine_load()
    flops, size = measure_matmul(dtype)
    flops = float(flops)
    name = str(dtype).removeprefix("torch.")
    source = f"measured: {size}x{size} {name} torch.mm on {threads} thread{'' if threads == 1 else 's'}"
    if machine_busy(load, cores):
        where = f"load {load:.1f} on {cores} core{'' if cores == 1 else 's'}"
        busy = f"{source} while the machine was busy ({where}; not cached)"
        if old is not None and old["flops"] > flops:  # the older figure is the better ceiling
            return old["flops"], old["source"] + f" (cached in {path})"
        return flops, busy
    if old is not None and old["flops"] > flops:  # keep the best: a figure only load can lower
        flops, size, source = old["flops"], old["size"], old["source"]
    entries[key] = {
        "flops": flops,
        "size": size,
        "source": source,
        "date": time.strftime("%Y-%m-%d"),
        "load": None if load is None else round(load, 2),  # None: the OS reports none
        "cores": cores,
    }
    try:
        write_json(path, {"version": CACHE_VERSION, "peaks": entries})
    except OSError as err:  # a read-only home: measure again next time
        logger.info("could not cache the CPU's matmul peak in %s: %s", path, err)
    return flops, source
