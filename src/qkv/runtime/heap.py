"""Process memory: how much is resident, and keeping it from growing over a long training run.

Token-count batches give the model a different ``(batch, length)`` shape on most steps, so every
step frees and allocates tensors of new sizes. Two things can then hold on to memory that the
program no longer uses:

* **glibc malloc.** PyTorch's CPU allocator is plain ``posix_memalign``/``free``. glibc serves big
  blocks with ``mmap`` at first, but each time such a block is freed it raises its mmap threshold to
  that block's size (up to 32 MiB on 64-bit), so after the first step nearly every activation comes
  from the heaps instead (the main heap and one arena per thread). glibc gives heap memory back to
  the OS only from the top of a heap, so the freed activations of the largest step stay resident
  (float32 Multi30k on a 2-core AVX2 CPU: 1.2 GB of heap, of which 0.24 GB in use between steps),
  and holes of many sizes, pinned by longer-lived blocks between them, let the heaps creep upward.
  :func:`trim_heap` (``malloc_trim(0)``) hands every free page inside the heaps back to the OS;
  :class:`HeapTrimmer` does it every few steps (about 0.1-0.2 s a call with a 1 GB heap).
  The other way round, glibc also gives back the top of a heap on every ``free`` that leaves more
  than its trim threshold free there (twice the sliding mmap threshold: 32 MiB once a 16 MiB block
  has been freed), and a training step frees ~100 MB of activations at once: the next step
  page-faults them all in again (14,000-22,500 minor faults a bf16 Multi30k step on a 2-core AMX
  Xeon, benchmarks/results/performance/heap_top_steps_xeon_amx_bf16.json).
  :func:`keep_heap_top` raises that threshold so freed memory stays for the next step, and leaves
  the returning to :class:`HeapTrimmer`.
  :func:`mmap_large_allocations` goes further and keeps big blocks out of the heaps altogether
  (between steps 0.57 GB resident instead of 1.4 GB), but every step then page-faults its
  activations in afresh: 45% longer steps on that CPU, so it is opt-in.
* **oneDNN's primitive cache.** Where PyTorch runs matrix products through oneDNN (bfloat16 on CPUs
  with AVX512-BF16 or AMX; on AVX2-only CPUs bf16 matmuls do not use oneDNN at all), each new shape
  creates and caches a compiled primitive, up to 1024 by default. oneDNN reads
  ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` once, when the process creates its first primitive, not when
  torch is imported (checked with ``ONEDNN_VERBOSE=2``): :func:`cap_onednn_primitive_cache` sets it,
  and must run before the first oneDNN operation of the process (qkv's bf16 speed probe is one).

:func:`limit_memory_growth` applies the process-wide settings once, at start-up; a training loop
then calls :meth:`HeapTrimmer.step` after each optimizer step and may log :func:`memory_snapshot`.
Everything here is a no-op, returning None, where it does not apply (not Linux, not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from dataclasses import dataclass

_STATUS = "/proc/self/status"
_MIB = 2**20
M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * _MIB  # glibc's limit on 64-bit (HEAP_MAX_SIZE / 2)
# free memory glibc may keep at the top of a heap (keep_heap_top): above a step's ~100 MB of activations,
# so the next step finds them mapped (the measurements: docs/history/code-comments.md)
HEAP_TRIM_THRESHOLD = 256 * _MIB
# the user's own malloc settings, which keep_heap_top leaves alone
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
# oneDNN primitives kept (~1 MB each for a Multi30k product): room for every product shape of a
# training run once qkv.runtime.padded_linear pads the rows of linear layers (a few hundred), so no step
# compiles again; far fewer recompiles every step, far more fills memory with unpadded shapes (the
# measurements: docs/history/code-comments.md)
ONEDNN_CACHE_CAPACITY = 512


def _status_kib(key: str) -> int | None:
    try:
        with open(_STATUS, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmRSS:\t  123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_memory_bytes() -> int | None:
    """The process's resident set size (``VmRSS`` in ``/proc/self/status``) in bytes; None where
    that file does not exist (not Linux)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_resident_memory_bytes() -> int | None:
    """The process's largest resident set size so far (``VmHWM``) in bytes; None where unknown."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None (another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None  # musl has no malloc_trim
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_stats() -> dict[str, int] | None:
    """glibc's ``mallinfo2()`` in bytes: ``heap`` (taken from the OS for the heaps, all arenas),
    ``in_use`` (allocated from the heaps), ``free`` (free inside the heaps: still resident unless
    trimmed), ``trimmable`` (free at the top of the main heap) and ``mmapped`` (blocks served by
    their own mmap). None where unavailable (not glibc, or glibc before 2.33).

    Growth in ``free`` is fragmentation (trimming helps); growth in ``in_use`` is something
    holding on to allocations (a cache or a leak; trimming does not help).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {
        "heap": info.arena,
        "in_use": info.uordblks,
        "free": info.fordblks,
        "trimmable": info.keepcost,
        "mmapped": info.hblkhd,
    }


def memory_snapshot() -> dict[str, float]:
    """Resident memory and glibc's heap figures in MB (1 MB = 2**20 bytes), for a log line:
    ``rss_mb``, ``peak_rss_mb``, ``heap_mb``, ``heap_in_use_mb``, ``heap_free_mb``, ``mmapped_mb``.
    Figures that this platform cannot give are left out (an empty dict off Linux)."""
    out: dict[str, float] = {}
    for key, value in (("rss_mb", resident_memory_bytes()), ("peak_rss_mb", peak_resident_memory_bytes())):
        if value is not None:
            out[key] = round(value / _MIB, 1)
    heap = heap_stats()
    if heap is not None:
        for key, name in (
            ("heap_mb", "heap"),
            ("heap_in_use_mb", "in_use"),
            ("heap_free_mb", "free"),
            ("mmapped_mb", "mmapped"),
        ):
            out[key] = round(heap[name] / _MIB, 1)
    return out


def trim_heap() -> bool | None:
    """Return the free memory inside glibc's heaps to the OS (``malloc_trim(0)``, every arena).

    Returns True when some memory was released, False when there was none to release, and None
    where glibc is not the C library (nothing is done). Safe to call at any time from any thread.
    """
    libc = _libc()
    if libc is None:
        return None
    return bool(libc.malloc_trim(0))


def mmap_large_allocations(threshold: int = _MIB) -> bool | None:
    """Serve every allocation of ``threshold`` bytes or more with its own ``mmap``, unmapped (and so
    returned to the OS) the moment it is freed: ``mallopt(M_MMAP_THRESHOLD, threshold)``, which also
    stops glibc from raising the threshold to 32 MiB. Activations then never stay in the heaps.

    Process-wide, and only effective before the heaps have filled with freed large blocks: call it
    at start-up, before the first training step. The cost is a page fault per 4 KiB of every large
    allocation: a Multi30k step of the library recipe took 2.8 s instead of 1.9 s on an idle 2-core
    AVX2 CPU with 1 MiB (4 MiB: 2.7 s, and 1.1 GB resident instead of 1.4). Returns True when set,
    None where glibc is not the C library.
    """
    if not 0 < threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"threshold must be in (0, {MMAP_THRESHOLD_MAX}] bytes, got {threshold}")
    libc = _libc()
    if libc is None:
        return None
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def keep_heap_top(trim_threshold: int = HEAP_TRIM_THRESHOLD) -> bool | None:
    """Let glibc keep up to ``trim_threshold`` bytes of free memory at the top of a heap instead of
    returning it to the OS on every ``free`` (``mallopt(M_TRIM_THRESHOLD)``), so the activations a
    training step frees serve the next step without page faults; :class:`HeapTrimmer` still hands
    free memory back every few steps. Setting it turns off glibc's sliding mmap threshold, so this
    also sets that threshold where glibc's own rule ends up (32 MiB: blocks below it come from the
    heaps, as they do after a first step anyway).

    Process-wide: call it at start-up. Left alone (returns False) where the user set glibc's malloc
    variables (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or malloc
    tunables in ``GLIBC_TUNABLES``); None where glibc is not the C library; True when set.
    """
    if not 0 < trim_threshold < 2**31:
        raise ValueError(f"trim_threshold must be in (0, 2 GiB) bytes, got {trim_threshold}")
    if any(name in os.environ for name in _MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    if libc is None:
        return None
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold))
    )


def cap_onednn_primitive_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> bool:
    """Bound oneDNN's primitive cache (a compiled primitive per operation and shape; oneDNN's
    default holds 1024) by setting ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, unless the user set it or
    the older ``DNNL_PRIMITIVE_CACHE_CAPACITY`` (theirs wins).

    oneDNN reads it when the process creates its first primitive, so call this before the first
    oneDNN operation (importing torch first is fine; a bf16 matrix product on a CPU with AVX512-BF16
    or AMX, such as :func:`qkv.runtime.precision.bf16_is_fast`'s probe, is one). Returns True when this call
    set it.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be non-negative, got {capacity}")
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ or "DNNL_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    return True


def limit_memory_growth(
    *,
    onednn_cache_capacity: int | None = ONEDNN_CACHE_CAPACITY,
    heap_trim_threshold: int | None = HEAP_TRIM_THRESHOLD,
    mmap_threshold: int | None = None,
) -> dict:
    """The process-wide settings, applied once at start-up (before the first oneDNN operation and
    the first training step): cap oneDNN's primitive cache (None: leave it), keep up to
    ``heap_trim_threshold`` bytes free at the top of the heaps between steps (:func:`keep_heap_top`;
    None: glibc's default), and optionally serve allocations of ``mmap_threshold`` bytes or more
    with mmap (None: glibc's default; it wins over the mmap threshold that keep_heap_top sets).
    Returns what was done, for a log line: ``{"onednn_primitive_cache": capacity or None,
    "heap_trim_threshold": bytes or None, "mmap_threshold": bytes or None}``."""
    done: dict = {"onednn_primitive_cache": None, "heap_trim_threshold": None, "mmap_threshold": None}
    if onednn_cache_capacity is not None and cap_onednn_primitive_cache(onednn_cache_capacity):
        done["onednn_primitive_cache"] = onednn_cache_capacity
    if heap_trim_threshold is not None and keep_heap_top(heap_trim_threshold):
        done["heap_trim_threshold"] = heap_trim_threshold
    if mmap_threshold is not None and mmap_large_allocations(mmap_threshold):
        done["mmap_threshold"] = mmap_threshold
    return done


@dataclass
class HeapTrimmer:
    """Calls :func:`trim_heap` every ``every_steps`` training steps and keeps count of its cost.

    ``trimmer.step(n)`` after optimizer step ``n``; ``every_steps <= 0`` turns it off.
    """

    every_steps: int = 50
    calls: int = 0
    seconds: float = 0.0  # spent in trim_heap
    released: int = 0  # calls that gave memory back

    def step(self, step: int) -> bool | None:
        """Trim when ``step`` is a multiple of ``every_steps``; returns :func:`trim_heap`'s result
        then, else None."""
        if self.every_steps <= 0 or step % self.every_steps:
            return None
        start = time.perf_counter()
        result = trim_heap()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.released += bool(result)
        return result
