import json

import pytest
from bench_loader import load_benchmark

from qkv.runtime.heap import HEAP_TRIM_THRESHOLD, _libc


@pytest.mark.slow  # two training processes on Multi30k: about 35 s (qkv.runtime.heap's own tests stay in the default suite)
def test_heap_top_benchmark_alternates_processes_and_reports_each(multi30k_dir, tmp_path):
    heap_top = load_benchmark("heap_top")
    out = tmp_path / "heap_top.json"
    assert (
        heap_top.main(
            [
                "--data",
                str(multi30k_dir),
                "--precisions",
                "float32",
                "--rounds",
                "1",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    rounds = report["results"]["float32"]["rounds"]
    assert len(rounds) == 1
    for pair in rounds:
        kept, default = pair["heap top kept"], pair["glibc's default"]
        # each variant ran in its own process with its own start-up settings
        assert default["settings"]["heap_trim_threshold"] is None
        assert kept["settings"]["heap_trim_threshold"] == (HEAP_TRIM_THRESHOLD if _libc() is not None else None)
        assert pair["kept_over_default"] == round(kept["tokens_per_s"] / default["tokens_per_s"], 3)
    assert report["machine"]["cpu_count"] >= 1
