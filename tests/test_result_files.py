"""A benchmark never replaces an existing result file unless told to (--overwrite), and refuses
before any work; qkv bench and the synthetic-corpus generator follow the same rule."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from bench_loader import BENCHMARKS, load_benchmark

from qkv.bench.results import add_result_options, check_result_file
from qkv.runtime.fileio import check_output_file

OLD = '{"a figure": "someone measured for an hour"}\n'


def test_check_output_file_keeps_an_existing_file_only_when_asked(tmp_path):
    old = tmp_path / "result.json"
    old.write_text(OLD)
    assert check_output_file(old, "--out") == old  # the default: callers that replace, like qkv translate -o
    with pytest.raises(FileExistsError, match="result.json: exists; pass --overwrite .* another --out"):
        check_output_file(old, "--out", overwrite=False)
    dangling = tmp_path / "link.json"
    dangling.symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(FileExistsError):  # a link is somebody's, even when what it names is gone
        check_output_file(dangling, "--out", overwrite=False)
    assert check_output_file(tmp_path / "new.json", "--out", overwrite=False) == tmp_path / "new.json"
    with pytest.raises(IsADirectoryError):
        check_output_file(tmp_path, "--out", overwrite=True)
    assert old.read_text() == OLD and not (tmp_path / "new.json").exists()


def test_result_options_refuse_in_one_line_and_overwrite_allows(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="bench")
    add_result_options(parser, tmp_path / "default.json")
    old = tmp_path / "old.json"
    old.write_text(OLD)
    with pytest.raises(SystemExit) as stop:
        check_result_file(parser, parser.parse_args(["--out", str(old)]))
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bench: error: {old}: exists; pass --overwrite to replace it, or choose another --out"
    )
    assert check_result_file(parser, parser.parse_args(["--out", str(old), "--overwrite"])) == old
    assert check_result_file(parser, parser.parse_args([])) == tmp_path / "default.json"
    assert old.read_text() == OLD


# script, its arguments ({out}: an existing result file, {dir}: an empty folder), what must not appear
REFUSALS = [
    ("train_multi30k", ["--minutes", "1", "--out", "{out}", "--run-dir", "{dir}/run"], "{dir}/run"),
    (
        "train_multi30k_ensemble",
        ["--members", "2", "--minutes", "1", "--out", "{out}", "--run-dir", "{dir}/ens"],
        "{dir}/ens",
    ),
    ("demo_time", ["--out", "{out}"], None),
    ("significance", ["--run", "a={dir}/a", "--run", "b={dir}/b", "--out", "{out}"], None),
    (
        "recipe_sweep",
        ["--collect", str(BENCHMARKS / "results" / "multi30k" / "multi30k_en_de_xeon_bf16.json"), "--out", "{out}"],
        None,
    ),
    ("explorer_draw", ["--output", "{out}"], None),
    ("heap_top", ["--data", "{dir}", "--out", "{out}"], None),
    ("cpu_step_paths", ["--out", "{out}"], None),
    ("memory", ["--out", "{out}", "--figure", "{dir}/memory.png"], "{dir}/memory.png"),
    ("paper_scale", ["--work", "{dir}/work", "--out", "{out}"], "{dir}/work"),
    ("compare_runs", ["--run", "a={dir}/a.jsonl", "--run", "b={dir}/b.jsonl", "--out", "{out}"], None),
    ("crash_consistency", ["--out", "{out}"], None),
    ("deploy_agreement", ["--run", "{dir}/run", "--out", "{out}"], None),
    ("decoding_engines", ["--run", "{dir}/run", "--out", "{out}"], None),
    ("decoding_profile", ["--run", "{dir}/run", "--out", "{out}"], None),
    ("decoding_products", ["--out", "{out}"], None),
    ("lm_score", ["--run", "{dir}/run", "--out", "{out}"], None),
    ("lm_vs_nanogpt", ["--nanogpt", "{dir}/nanogpt", "--minutes", "5", "--out", "{out}"], "{dir}/nanogpt/out"),
    ("gpu", ["--dry-run", "--out", "{out}"], None),
    ("lm_samples", ["--run", "{dir}/run", "--nanogpt-ckpt", "{dir}/ckpt", "--out", "{out}"], None),
]


@pytest.mark.parametrize("script,argv,absent", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_benchmark_refuses_an_existing_result_before_any_work(script, argv, absent, tmp_path, monkeypatch, capsys):
    out = tmp_path / "result.json"
    out.write_text(OLD)
    work = tmp_path / "work_folder"
    work.mkdir()
    fill = {"{out}": str(out), "{dir}": str(work)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    module = load_benchmark(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *map(filled, argv)])
    try:
        code = module.main()
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == OLD
    if absent is not None:
        assert not Path(filled(absent)).exists()


def test_qkv_bench_keeps_an_earlier_suite_result_unless_overwrite(tmp_path, capsys):
    from qkv.cli import main

    argv = [
        "bench",
        "attention",
        "--quick",
        "--seq-lens",
        "16",
        "--contenders",
        "qkv_fast",
        "--dtypes",
        "float32",
        "--passes",
        "forward",
        "--out",
        str(tmp_path),
    ]
    (tmp_path / "attention.json").write_text(OLD)
    assert main(argv) == 2
    assert "attention.json: exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "attention.json").read_text() == OLD and not (tmp_path / "attention.png").exists()
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((tmp_path / "attention.json").read_text())["suite"] == "attention"


def test_the_corpus_generator_keeps_files_already_in_its_folder(tmp_path, capsys):
    make_wmt_like = load_benchmark("make_wmt_like")
    mine = tmp_path / "train.en"
    mine.write_text("a user's own corpus\n")
    argv = ["--pairs", "50", "--valid-pairs", "10", "--vocab", "100", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        make_wmt_like.main(argv)
    assert stop.value.code == 2 and "train.en exist: pass --overwrite" in capsys.readouterr().err
    assert mine.read_text() == "a user's own corpus\n" and not (tmp_path / "train.de").exists()
    assert make_wmt_like.main([*argv, "--overwrite"]) == 0
    assert len((tmp_path / "train.en").read_text().splitlines()) == 50


def test_every_benchmark_that_writes_a_result_declares_overwrite():
    """A new benchmark script cannot forget the rule: any script that writes a JSON or a figure
    declares --overwrite (add_result_options, or by hand where a child process must not import
    qkv.bench). Wrappers of qkv bench inherit it from there."""
    missing = []
    for path in sorted(BENCHMARKS.glob("**/*.py")):  # the suites and benchmarks/studies/
        text = path.read_text()
        writes = "write_json(" in text or "write_result(" in text or ".savefig(" in text
        if writes and "add_result_options" not in text and '"--overwrite"' not in text:
            missing.append(path.name)
    assert missing == []
