"""benchmarks/decoding_engines.py --quick on a tiny dates run: the result JSON has its provenance, a timing
for every engine and a BLEU for each; the exact engines (CTranslate2 float32, onnxruntime, Hugging Face
generate) translate the timed sentences as qkv does, which checks the benchmark's plumbing (same
batches, same length limit, ids mapped back) against independent implementations. No timing is
asserted."""

import json
import math

import pytest
import torch
from bench_loader import load_benchmark

from qkv.cli import main as qkv_main

pytest.importorskip("ctranslate2")
pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # trains a run and makes four exports: about a minute


@pytest.fixture(scope="module")
def dates_run(tmp_path_factory):
    """A post-LN GELU dates model trained 150 steps: varied translations that end with EOS."""
    run_dir = tmp_path_factory.mktemp("engines") / "run"
    options = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
    options += ["--no-norm-first", "--activation", "gelu", "--max-tokens", "800", "--no-progress", "--threads", "1"]
    budget = ["--max-steps", "150", "--minutes", "0", "--eval-every-steps", "0"]
    assert qkv_main(["train", "--data", "dates", "--run-dir", str(run_dir), *budget, *options]) == 0
    torch.set_num_threads(1)
    return run_dir


def test_quick_run_writes_every_engine_with_its_bleu(dates_run, tmp_path):
    bench = load_benchmark("decoding_engines")
    out = tmp_path / "engines.json"
    args = ["--run", str(dates_run), "--quick", "--out", str(out), "--exports", str(tmp_path / "exports")]
    assert bench.main([*args, "--with-gnmt", "--before", "HEAD"]) == 0
    report = json.loads(out.read_text())
    for field in ("machine", "command", "date", "commit"):
        assert report[field]
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
