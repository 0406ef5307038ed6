import os
import sys

import pytest
import torch

from qkv.runtime import heap as memory

linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc/self/status (Linux)")


@linux
def test_resident_memory_is_plausible_and_grows_with_touched_memory():
    before = memory.resident_memory_bytes()
    assert isinstance(before, int) and 10 * 2**20 < before < 2**40
    block = torch.ones(200 * 2**20 // 4)  # 200 MiB, every page written
    after = memory.resident_memory_bytes()
    assert after - before > 150 * 2**20
    assert memory.peak_resident_memory_bytes() >= after
    del block


def test_status_missing_gives_none(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_STATUS", str(tmp_path / "absent"))
    assert memory.resident_memory_bytes() is None
    assert memory.peak_resident_memory_bytes() is None


def test_status_without_the_field_gives_none(monkeypatch, tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  100 kB\n")
    monkeypatch.setattr(memory, "_STATUS", str(status))
    assert memory.resident_memory_bytes() is None


def test_trim_heap_is_safe_and_returns_memory():
    result = memory.trim_heap()
    if memory._libc() is None:
        assert result is None
        return
    assert result in (True, False)
    # freed blocks inside the heap: many tensors of different sizes, every other one kept alive
    kept = [torch.ones(2**16 + 4096 * i) for i in range(200)]
    del kept[::2]
    assert memory.trim_heap() in (True, False)
    memory.trim_heap()  # twice in a row: nothing left to give back, still fine


def test_heap_stats_fields():
    stats = memory.heap_stats()
    if stats is None:
        pytest.skip("no mallinfo2 (not glibc >= 2.33)")
    assert set(stats) == {"heap", "in_use", "free", "trimmable", "mmapped"}
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())
    assert stats["in_use"] <= stats["heap"]


def test_non_linux_is_a_no_op(monkeypatch):
    memory._libc.cache_clear()
    monkeypatch.setattr(sys, "platform", "win32")
    try:
        assert memory._libc() is None
        assert memory.trim_heap() is None
        assert memory.heap_stats() is None
    finally:
        memory._libc.cache_clear()


def _unset_cache_variables(monkeypatch):
    # setenv first, so that monkeypatch restores the original state (unset) after the test
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def test_cap_onednn_primitive_cache_respects_the_user(monkeypatch):
    _unset_cache_variables(monkeypatch)
    assert memory.cap_onednn_primitive_cache(16) is True
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert memory.cap_onednn_primitive_cache(16) is False
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    with pytest.raises(ValueError):
        memory.cap_onednn_primitive_cache(-1)


def test_heap_trimmer_counts(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1) or True)
    trimmer = memory.HeapTrimmer(every_steps=3)
    results = [trimmer.step(n) for n in range(1, 10)]
    assert results == [None, None, True, None, None, True, None, None, True]
    assert trimmer.calls == 3 == len(calls) and trimmer.released == 3 and trimmer.seconds >= 0
    off = memory.HeapTrimmer(every_steps=0)
    assert all(off.step(n) is None for n in range(1, 5)) and off.calls == 0


def test_memory_snapshot_keys():
    snap = memory.memory_snapshot()
    if os.path.exists("/proc/self/status"):
        assert snap["rss_mb"] > 10 and snap["peak_rss_mb"] >= snap["rss_mb"] - 1
    if memory.heap_stats() is not None:
        assert {"heap_mb", "heap_in_use_mb", "heap_free_mb", "mmapped_mb"} <= set(snap)
    assert all(isinstance(v, float) for v in snap.values())


def test_mmap_large_allocations_checks_and_applies():
    with pytest.raises(ValueError):
        memory.mmap_large_allocations(0)
    with pytest.raises(ValueError):
        memory.mmap_large_allocations(64 * 2**20)
    # glibc's largest threshold: what its dynamic threshold reaches anyway, so the test process's
    # allocation behaviour does not change
    result = memory.mmap_large_allocations(memory.MMAP_THRESHOLD_MAX)
    assert result is (None if memory._libc() is None else True)


def test_limit_memory_growth(monkeypatch):
    _unset_cache_variables(monkeypatch)
    monkeypatch.setattr(memory, "mmap_large_allocations", lambda threshold: True)
    kept = []
    monkeypatch.setattr(memory, "keep_heap_top", lambda threshold: kept.append(threshold) or True)
    capacity, top = memory.ONEDNN_CACHE_CAPACITY, memory.HEAP_TRIM_THRESHOLD
    assert memory.limit_memory_growth() == {
        "onednn_primitive_cache": capacity,
        "heap_trim_threshold": top,
        "mmap_threshold": None,
    }
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(capacity)
    # already set (by the user or an earlier call): left alone
    assert memory.limit_memory_growth(onednn_cache_capacity=4, mmap_threshold=2**20) == {
        "onednn_primitive_cache": None,
        "heap_trim_threshold": top,
        "mmap_threshold": 2**20,
    }
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(capacity)
    assert memory.limit_memory_growth(onednn_cache_capacity=None, heap_trim_threshold=None) == {
        "onednn_primitive_cache": None,
        "heap_trim_threshold": None,
        "mmap_threshold": None,
    }
    assert kept == [top, top]


def test_keep_heap_top_checks_and_respects_the_user(monkeypatch):
    for bad in (0, 2**31):
        with pytest.raises(ValueError):
            memory.keep_heap_top(bad)
    for name, value in (
        ("MALLOC_TRIM_THRESHOLD_", "1000000"),
        ("MALLOC_MMAP_THRESHOLD_", "1000000"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000"),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert memory.keep_heap_top() is False


# Freed blocks at the top of the heap, then the same sizes again: how many pages come back from the OS
# afresh (minor faults) the second time. Round 1 (16 MiB blocks, mmapped) only lifts glibc's sliding
# mmap threshold, as a first training step does; rounds 2 and 3 (15 MiB blocks) come from the heap.
_HEAP_TOP_PROBE = """
import ctypes, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    from qkv.runtime.heap import keep_heap_top
    assert keep_heap_top() is True
def round_trip(size):
    blocks = [libc.malloc(size) for _ in range(8)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in reversed(blocks):
        libc.free(b)
round_trip(16 << 20)
round_trip(15 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip(15 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@linux
def test_keep_heap_top_stops_the_next_step_faulting_its_memory_in_again():
    import subprocess

    if memory._libc() is None:
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _HEAP_TOP_PROBE, mode], env=env, check=True, capture_output=True, text=True
        ).stdout
        return int(out.split()[-1])

    pages = 8 * (15 << 20) // 4096
    default, kept = faults("default"), faults("keep")
    assert default > pages // 2  # glibc's own rule gave the 120 MiB back and faults it in again
    assert kept < pages // 20  # kept at the top of the heap: no page comes back from the OS afresh
