"""benchmarks/compare_runs.py: the side-by-side table of two runs' speed and memory, checked against
figures worked out by hand from the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_loader import load_benchmark


@pytest.fixture(scope="module")
def compare_runs():
    return load_benchmark("compare_runs")


def write_metrics(path: Path, rows: list[tuple[int, float, float, float]]) -> Path:
    lines = [json.dumps({"event": "valid", "step": 1, "minutes": 0.5, "val_loss": 3.0})]
    lines += [
        json.dumps({"event": "train", "step": s, "minutes": m, "loss": 1.0, "tokens_per_s": t, "rss_mb": r})
        for s, m, t, r in rows
    ]
    path.write_text("\n".join(lines) + '\n{"event": "tra', encoding="utf-8")  # a torn last line
    return path


def test_table_and_ratios(tmp_path, compare_runs):
    a = write_metrics(
        tmp_path / "a.jsonl", [(10, 1.0, 100, 500), (20, 2.0, 300, 700), (30, 3.0, 200, 600), (40, 4.0, 100, 650)]
    )
    b = write_metrics(tmp_path / "b.jsonl", [(15, 1.0, 150, 900), (30, 2.0, 450, 1000), (45, 3.0, 300, 1100)])
    out = tmp_path / "out.json"
    assert compare_runs.main(["--run", f"A={a}", "--run", f"B={b}", "--window", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["common_minutes"] == 3.0  # B logged only 3 minutes: A is cut there too
    ra, rb = report["runs"]["A"], report["runs"]["B"]
    assert ra["step_at_common_minutes"] == 30 and rb["step_at_common_minutes"] == 45
    assert ra["tokens_per_s_median"] == 200 and rb["tokens_per_s_median"] == 300
    assert rb["steps_ratio"] == 1.5 and rb["tokens_per_s_ratio"] == 1.5 and ra["steps_ratio"] == 1.0
    assert ra["rss_mb_median"] == 600 and ra["rss_mb_max"] == 700
    # windows (0, 2] and (2, 3]
    assert ra["windows"] == [
        {"minutes": [0.0, 2.0], "step": 20, "tokens_per_s_median": 200.0, "rss_mb_median": 600.0, "rss_mb_max": 700},
        {"minutes": [2.0, 3.0], "step": 30, "tokens_per_s_median": 200.0, "rss_mb_median": 600.0, "rss_mb_max": 600},
    ]
    assert report["machine"]["amx"] in (True, False)


def test_bad_input_is_a_usage_error(tmp_path, compare_runs):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    good = write_metrics(tmp_path / "g.jsonl", [(1, 1.0, 1, 1)])
    for argv in (
        ["--run", f"A={good}"],
        ["--run", "A", "--run", f"B={good}"],
        ["--run", f"A={empty}", "--run", f"B={good}"],
        ["--run", f"A={good}", "--run", f"A={good}"],
        ["--run", f"A={tmp_path / 'missing'}", "--run", f"B={good}"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            compare_runs.main([*argv, "--out", str(tmp_path / "x.json")])
        assert exit_info.value.code == 2
    assert not (tmp_path / "x.json").exists()
