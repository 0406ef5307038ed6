"""benchmarks/decoding_engines.py.

With fake engines (cheap pure-Python decoders, defined here at module level so that a spawned worker
imports them): every engine runs in a process of its own, none in the test's, and the engines' timed
passes never overlap (each engine is timed alone, engines in turn); a failing engine stops the run with
one line naming it, and no worker is left behind.

--quick on a tiny dates run (slow): the result JSON has its provenance, a timing for every engine and a
BLEU for each; the exact engines (CTranslate2 float32, onnxruntime, Hugging Face generate) translate the
timed sentences as qkv does, which checks the benchmark's plumbing (same batches, same length limit, ids
mapped back) against independent implementations. No timing is asserted."""

import json
import math
import os
import time

import pytest
import torch
from bench_loader import load_benchmark


def fake_engines(threads: int, fail: str | None = None) -> dict:
    """Fake engines, built in a worker: each "translation" is the thread count, then the source reversed.
    ``fail``: "build" raises here, "decode" raises in the engine named ``broken``."""
    if fail == "build":
        raise ValueError("no such model folder")

    def decode(batch: list[list[int]]) -> list[list[int]]:
        time.sleep(0.002)  # a pass that lasts: the engines' intervals have a length
        return [[threads, *reversed(sentence)] for sentence in batch]

    def broken(batch: list[list[int]]) -> list[list[int]]:
        raise RuntimeError("the decoder gave up\nsecond line")

    names = ("qkv_greedy", "qkv_greedy_before", "ct2_float32_greedy", "fine")
    return dict.fromkeys(names, decode) | {"broken": broken if fail == "decode" else decode}


IDS = [[4 + i % 9] * (1 + i % 5) + [2] for i in range(10)]  # 10 sentences of 2 to 6 ids


def test_each_engine_is_timed_alone_in_a_process_of_its_own():
    bench = load_benchmark("decoding_engines")
    names = ["qkv_greedy", "qkv_greedy_before", "ct2_float32_greedy"]
    specs = [bench.EngineSpec(name, fake_engines) for name in names]
    batches = bench.sorted_batches(IDS, 4)
    with bench.EngineWorkers(specs, threads=2) as workers:
        passes = bench.timed_passes(workers, bench.batch_ids(IDS, batches), repeats=3, pause=0.01)
        results = bench.time_engines(workers, IDS, batches, repeats=1, pause=0.0)
        processes = list(workers.processes.values())
    assert not any(p.is_alive() for p in processes)  # stopped on leaving the context
    pids = {name: {p["pid"] for p in runs} for name, runs in passes.items()}
    assert all(len(p) == 1 for p in pids.values())  # one worker per engine, for all its passes
    assert len(set.union(*pids.values())) == len(names) and os.getpid() not in set.union(*pids.values())
    intervals = sorted((p["start"], p["end"], name) for name, runs in passes.items() for p in runs)
    assert len(intervals) == 3 * len(names)
    for (_, end, name), (start, _, after) in zip(intervals, intervals[1:]):
        assert end <= start, f"{name}'s timed pass overlaps {after}'s"
    firsts = [min(names, key=lambda n: passes[n][r]["start"]) for r in range(3)]
    assert firsts == names  # the order rotated each repeat
    for runs in passes.values():  # built at the thread count; the outputs come back batch by batch
        assert runs[-1]["outputs"] == [[[2, *reversed(IDS[i])] for i in batch] for batch in batches]
    assert list(results) == names
    for r in results.values():  # the report's fields (no timing's size asserted)
        assert r["sentences"] == len(IDS) and r["target_tokens"] == sum(len(s) + 1 for s in IDS)
        assert {"median_s", "times_s", "sentences_per_s", "tokens_per_s", "time_over_ct2_float32"} <= set(r)
    assert results["qkv_greedy"]["same_output_as_before"] is True and "speedup_over_before" in results["qkv_greedy"]


@pytest.mark.parametrize("fail,doing", [("decode", "decoding"), ("build", "building")])
def test_a_failing_engine_stops_the_run_with_one_line_naming_it(fail, doing):
    bench = load_benchmark("decoding_engines")
    specs = [bench.EngineSpec("fine", fake_engines), bench.EngineSpec("broken", fake_engines, dict(fail=fail))]
    workers = bench.EngineWorkers(specs, threads=1)
    batches = bench.sorted_batches(IDS, 4)
    with pytest.raises(bench.EngineFailed) as err, workers:
        bench.time_engines(workers, IDS, batches, repeats=1, pause=0.0)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"engine broken failed in its worker while {doing}"), message
    assert ("the decoder gave up" if fail == "decode" else "ValueError: no such model folder") in message
    assert workers.processes and not any(p.is_alive() for p in workers.processes.values())


def test_an_engine_builder_must_be_importable_by_the_worker():
    bench = load_benchmark("decoding_engines")
    with pytest.raises(ValueError, match="module-level"):
        bench.EngineWorkers([bench.EngineSpec("x", lambda threads: {})], threads=1).start()


@pytest.fixture(scope="module")
def dates_run(tmp_path_factory):
    """A post-LN GELU dates model trained 150 steps: varied translations that end with EOS."""
    from qkv.cli import main as qkv_main

    run_dir = tmp_path_factory.mktemp("engines") / "run"
    options = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
    options += ["--no-norm-first", "--activation", "gelu", "--max-tokens", "800", "--no-progress", "--threads", "1"]
    budget = ["--max-steps", "150", "--minutes", "0", "--eval-every-steps", "0"]
    assert qkv_main(["train", "--data", "dates", "--run-dir", str(run_dir), *budget, *options]) == 0
    torch.set_num_threads(1)
    return run_dir


@pytest.mark.slow  # trains a run, makes four exports and starts a worker per engine: about a minute
def test_quick_run_writes_every_engine_with_its_bleu(dates_run, tmp_path):
    for package in ("ctranslate2", "onnxruntime", "transformers"):
        pytest.importorskip(package)
    bench = load_benchmark("decoding_engines")
    out = tmp_path / "engines.json"
    args = ["--run", str(dates_run), "--quick", "--out", str(out), "--exports", str(tmp_path / "exports")]
    assert bench.main([*args, "--with-gnmt", "--before", "HEAD"]) == 0
    report = json.loads(out.read_text())
    for field in ("machine", "command", "date", "commit"):
        assert report[field]
    assert "process of its own" in report["settings"]["timing"]
    expected = {"qkv_greedy", "qkv_beam", "qkv_beam_gnmt", "hf_greedy", "hf_beam", "onnxruntime_greedy"}
    expected |= {f"ct2_{kind}_{search}" for kind in ("float32", "int8") for search in ("greedy", "beam")}
    timed = report["threads"]["1"]
    assert expected | {"qkv_greedy_before", "qkv_beam_before", "qkv_beam_gnmt_before"} == set(timed)
    for r in timed.values():
        assert r["sentences"] == report["settings"]["sentences_timed"] > 0
        assert r["median_s"] > 0 and r["sentences_per_s"] > 0 and r["tokens_per_s"] > 0
        assert r["time_over_ct2_float32"] > 0
    assert timed["qkv_greedy"]["same_output_as_before"] and timed["qkv_beam"]["same_output_as_before"]
    assert set(report["engines"]) == expected
    for name, r in report["engines"].items():
        assert isinstance(r["bleu"], float) and math.isfinite(r["bleu"]) and 0 <= r["bleu"] <= 100, name
    assert report["engines"]["qkv_greedy"]["bleu"] > 0  # a trained model: the score is not empty
    for name in ("ct2_float32_greedy", "onnxruntime_greedy", "hf_greedy"):
        assert report["engines"][name]["equal_to_qkv_greedy"] == 1.0, name
        assert report["engines"][name]["bleu"] == report["engines"]["qkv_greedy"]["bleu"], name
    for name in ("ct2_float32_beam", "hf_beam"):  # the same search: power penalty, beam 5
        assert report["engines"][name]["equal_to_qkv_beam"] == 1.0, name
    assert report["headline"]["qkv_beam_bleu"] == report["engines"]["qkv_beam"]["bleu"]  # INDEX.md's figures
    assert report["headline"]["qkv_beam_time_over_ct2_float32_1_thread"] == timed["qkv_beam"]["time_over_ct2_float32"]
