"""benchmarks/results: every JSON says where it came from (machine, command, date, commit), INDEX.md is
what benchmarks/index.py writes from them today, and qkv.bench.provenance reports this machine as
/proc/cpuinfo and torch do."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_loader import BENCHMARKS, load_benchmark

from qkv.bench import provenance

RESULTS = BENCHMARKS / "results"
JSONS = sorted(RESULTS.rglob("*.json"))


def test_there_are_results_and_none_lies_loose():
    assert len(JSONS) > 100
    loose = [p.name for p in RESULTS.glob("*.json")]
    assert loose == [], "results belong in a topic folder (benchmarks/README.md lists them)"


def test_every_result_json_says_machine_command_date_and_commit():
    lacking = {}
    for path in JSONS:
        missing = provenance.missing_fields(json.loads(path.read_text()))
        if missing:
            lacking[str(path.relative_to(RESULTS))] = missing
    assert lacking == {}, "write results with qkv.bench.provenance.write_result"
    for path in JSONS:
        machine = json.loads(path.read_text())["machine"]
        assert isinstance(machine, dict), path
        absent = [
            k
            for k in ("cpu_model", "cpu_family", "cpu_model_number", "avx2", "avx512_bf16", "amx", "threads", "gpu")
            if k not in machine
        ]
        assert absent == [], (path, absent)


def test_index_md_is_what_the_script_writes_today():
    index = load_benchmark("index")
    assert (RESULTS / "INDEX.md").read_text() == index.render(), "stale: run python benchmarks/index.py"


def test_the_index_names_every_result_once():
    text = (RESULTS / "INDEX.md").read_text()
    for path in JSONS:
        assert text.count(f"| `{path.name}` |") == 1, path.name


def proc_cpuinfo() -> dict[str, str]:
    """The first processor's fields, read here independently of qkv.bench.timing."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo on this OS")
def test_provenance_reports_this_machine_as_cpuinfo_and_torch_do():
    found = provenance.machine()
    cpu = proc_cpuinfo()
    flags = set(cpu.get("flags", "").split())
    assert found["cpu_model"] == cpu.get("model name", "unknown")
    assert found["cpu_family"] == cpu.get("cpu family", "unknown")
    assert found["cpu_model_number"] == cpu.get("model", "unknown")
    assert found["avx2"] == ("avx2" in flags)
    assert found["avx512_bf16"] == ("avx512_bf16" in flags)
    assert found["amx"] == ("amx_bf16" in flags)
    assert found["threads"] == torch.get_num_threads()
    assert found["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def test_provenance_command_date_and_commit():
    assert provenance.command(["benchmarks/x.py", "--out", "a b.json"]) == "python benchmarks/x.py --out 'a b.json'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", provenance.utc_now())
    head = subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = provenance.git_commit(BENCHMARKS)
    if head.returncode == 0:
        assert commit.removesuffix("-dirty") == head.stdout.strip()
    else:
        assert commit == "unknown"


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    assert provenance.git_commit(tmp_path) == "unknown"


def test_write_result_adds_the_fields_and_keeps_the_reports_own(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/demo_time.py", "--runs", "1"])
    out = provenance.write_result(tmp_path / "r.json", {"figure": 1.5, "machine": {"threads": 1, "load": [0.1]}})
    report = json.loads(out.read_text())
    assert report["figure"] == 1.5
    assert report["command"] == "python benchmarks/demo_time.py --runs 1"
    assert report["machine"]["threads"] == 1 and report["machine"]["load"] == [0.1]
    assert set(provenance.machine()) <= set(report["machine"])
    assert provenance.missing_fields(report) == []
    kept = provenance.stamp({"command": "python by hand"})
    assert kept["command"] == "python by hand"
