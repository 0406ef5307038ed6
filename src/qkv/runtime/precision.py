"""bfloat16 autocast, and whether this machine runs it fast.

bfloat16 halves memory traffic, and on hardware with bf16 matrix units (recent NVIDIA GPUs; x86
CPUs with AVX512-BF16 or AMX; Arm CPUs with BF16) it speeds up training. On a CPU without them,
PyTorch emulates bf16 matrix products, and they can be tens of times slower than float32 (an AVX2
AMD EPYC: 3.45 s against 0.057 s for a 4000x256 @ 256x1024 product). So the recipes ask for bf16
only where :func:`bf16_is_fast` says it pays.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def autocast_context(device: torch.device | str, bf16: bool) -> contextlib.AbstractContextManager[object]:
    """bfloat16 autocast on ``device`` (CPU or CUDA) when ``bf16``, else a no-op context."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def _seconds(fn: Callable[[], object], repeats: int, budget: float = math.inf) -> float:
    """Best of ``repeats`` timings of ``fn()``, stopping early once they add up to ``budget`` seconds."""
    best, total = math.inf, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, total = min(best, elapsed), total + elapsed
        if total >= budget:
            break
    return best


@functools.cache
def cpu_bf16_probe(size: int = 256) -> tuple[float, float]:
    """Seconds for one ``size`` x ``size`` matrix product on the CPU in (float32, bfloat16), best of
    five each; the bfloat16 timings stop after 50 ms in all (emulated bf16 takes milliseconds a product).
    A product takes ~0.05-0.2 ms where bf16 is fast, so one timing alone can be a scheduler hiccup many
    times longer: a single sample once turned bf16 off on an AMX Xeon."""
    generator = torch.Generator().manual_seed(0)  # its own: probing must not move the caller's RNG
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    a @ b, a16 @ b16  # warm-up: kernels chosen, buffers allocated
    return _seconds(lambda: a @ b, 5), _seconds(lambda: a16 @ b16, 5, budget=0.05)


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 matrix products run at least as fast as float32 ones on ``device``.

    CUDA: the GPU supports bf16 natively. CPU: a timed probe (a 256 x 256 product in each
    precision, about 10-100 ms once per process), since PyTorch does not say whether its CPU
    kernels are emulated.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    fp32, bf16 = cpu_bf16_probe()
    return bf16 <= fp32


def bf16_where_fast(bf16: bool, device: torch.device | str, *, asked: bool) -> bool:
    """Whether a run uses bf16 autocast: ``bf16`` where bfloat16 products are fast on ``device``.
    Where they are slow, a recipe's bf16 is turned off (logged); one the user ``asked`` for is kept,
    with a warning."""
    if not bf16 or bf16_is_fast(device):
        return bf16
    if asked:
        logger.warning(
            "bf16 autocast asked for, but bfloat16 matrix products are slower than float32 on this %s "
            "(no bf16 matrix instructions): expect slow steps",
            torch.device(device).type,
        )
        return True
    logger.info("bf16 autocast off: this %s has no fast bfloat16 matrix products", torch.device(device).type)
    return False


def slow_bf16_reason(device: torch.device | str = "cpu") -> str | None:
    """Why bf16 is not worth running on ``device`` (with the probe's figures), or None."""
    if bf16_is_fast(device):
        return None
    if torch.device(device).type != "cpu":
        return f"bfloat16 is not supported natively on {device}"
    fp32, bf16 = cpu_bf16_probe()
    return (
        f"bfloat16 matrix products are emulated on this CPU ({torch.backends.cpu.get_cpu_capability()}): "
        f"a 256x256 product takes {bf16 / fp32:.0f}x the float32 time"
    )
