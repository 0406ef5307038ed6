"""Side-by-side benchmarks of qkv against PyTorch and Hugging Face (see ``qkv bench`` and
``benchmarks/``). Timing utilities are in :mod:`qkv.bench.timing`; the suites in
:mod:`qkv.bench.suites`."""

from qkv.bench.timing import Timing, environment, peak_memory_bytes, pick_device, ratio, time_interleaved

__all__ = ["Timing", "environment", "peak_memory_bytes", "pick_device", "ratio", "time_interleaved"]
