"""What a measurement was taken on: the CPU (model, family, feature flags), memory, threads, torch,
CUDA, and optionally how fast bf16 products run. Benchmarks and experiments record it beside
their figures, since a figure without its machine cannot be compared with another.
"""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path

import torch

from qkv.runtime.precision import cpu_bf16_probe


def cpuinfo_fields(*names: str) -> dict[str, str | None]:
    """The first processor's fields ``names`` in ``/proc/cpuinfo``, read once (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = {name: re.search(rf"^{re.escape(name)}\s*:(.*)$", text, flags=re.MULTILINE) for name in names}
    return {name: line.group(1).strip() if line else None for name, line in lines.items()}


def cpu_flags(flags: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none), or from its ``flags`` line."""
    return set((flags if flags is not None else cpuinfo_fields("flags")["flags"] or "").split())


def memory_gib() -> float | None:
    """The machine's physical memory in GiB (one decimal), or None where the OS does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def environment(*, probe_bf16: bool = False) -> dict:
    """What the figures were measured on, with whether the CPU has AVX512-BF16 and AMX (where bf16
    matrix products are fast, qkv.runtime.precision). ``probe_bf16``: also time qkv.runtime.precision's 256 x 256
    product probe in float32 and bf16 (10-100 ms), for figures that depend on bf16's speed."""
    cpu = cpuinfo_fields("flags", "model name", "cpu family", "model")
    flags = cpu_flags(cpu["flags"] or "")
    libc = platform.libc_ver()
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "platform": platform.platform(),
        "libc": " ".join(libc) if libc[0] else None,
        "memory_gib": memory_gib(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_bf16" in flags,
    }
    # kernels limited below what the CPU has (e.g. ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 runs an
    # AVX512 machine on the code paths of an AVX2-only one): say so beside the flags
    limits = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(name)}
    if limits:
        info["isa_limits"] = limits
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    # "AMD EPYC" alone names CPUs from AVX2-only ones to AVX512-BF16 ones: family and model tell them apart
    # (e.g. AMD family 25 model 17 is Zen 4, family 26 is Zen 5)
    info.update(cpu_model=cpu["model name"], cpu_family=cpu["cpu family"], cpu_model_number=cpu["model"])
    if probe_bf16:
        fp32, bf16 = cpu_bf16_probe()
        info["bf16_probe_seconds_256"] = {"float32": round(fp32, 6), "bfloat16": round(bf16, 6)}
    return info
