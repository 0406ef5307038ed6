"""benchmarks/step_matched_sweep.py: candidates train for the recipe's steps over their cost per step,
with the schedule and checkpoints of an hour laid over those steps, side by side, and their rows
score what qkv evaluate scores for the same runs."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
from bench_loader import load_benchmark

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("step_matched_sweep")


def test_steps_fit_the_seconds_and_stay_under_the_hour(sweep):
    assert sweep.steps_that_fit(14.2, 300, 11000) == 4200  # 4,260 fit: whole hundreds
    assert sweep.steps_that_fit(14.2, 3000, 11000) == 11000  # never past the hour asked for
    assert sweep.steps_that_fit(0.9, 60, 11000) == 54  # under a thousand: every step


def test_a_candidate_gets_the_steps_its_cost_allows_in_the_hour(sweep):
    assert sweep.candidate_steps("recipe", 11000) == 11000
    # R-Drop over the last 30% of the hour at twice the cost a step: 0.7 + 0.15 of the recipe's steps,
    # and it starts where 0.7 of the recipe's steps are done
    assert sweep.candidate_steps("rdrop_late", 11000) == 9350
    changes, _ = sweep.CANDIDATES["rdrop_late"]
    assert abs(changes["rdrop_start"] * 9350 - 0.7 * 11000) < 0.01 * 11000


@pytest.mark.slow  # minutes of subprocess training and decoding: run with -m slow
def test_candidates_train_side_by_side_and_score_as_qkv_evaluate_does(tmp_path, capsys, multi30k_dir):
    from qkv.cli import main

    root, out = tmp_path / "sweep", tmp_path / "sweep.json"
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "step_matched_sweep.py"),
        "--data",
        str(multi30k_dir),
        "--steps",
        "3",
        "--only",
        "recipe,lr07",
        "--eval-limit",
        "6",
        "--run-root",
        str(root),
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"recipe", "lr07"}
    for name, row in rows.items():
        config = json.loads((root / "runs" / name / "config.json").read_text())
        assert config["train"]["max_steps"] == 3 and config["train"]["max_minutes"] == 0
        assert config["train"]["checkpoint_every_steps"] == 1 and row["steps"] == 3
        assert config["train"]["lr_factor"] == 0.7  # the multi30k recipe's on every machine (qkv 1.0)
    run = root / "runs" / "lr07"
    bf16 = ["--bf16"] if json.loads((run / "config.json").read_text())["train"]["bf16"] else []
    assert main(["evaluate", str(run), "--split", "val", "--limit", "6", "--json", "--threads", "2", *bf16]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["chrf"] == rows["lr07"]["val_chrf"] and again["bleu"] == rows["lr07"]["val_bleu"]
    # the translations each run keeps (for benchmarks/significance.py) are the ones its row scored
    with gzip.open(multi30k_dir / "val.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()[:6]
    for name, row in rows.items():
        assert "scored" not in row  # the row written before decoding was replaced by the finished one
        hyps = (root / "runs" / name / "val.hyp.de").read_text(encoding="utf-8").splitlines()
        assert len(hyps) == 6 and (root / "runs" / name / "test_2016.hyp.de").is_file()
        assert round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2) == row["val_bleu"]

    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=600)  # would train over the runs
    assert rerun.returncode == 2 and "an earlier sweep's runs" in rerun.stderr
    bad = subprocess.run(
        [*argv[:2], "--only", "recipe,nope", "--run-root", str(tmp_path / "new"), "--out", str(tmp_path / "new.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "unknown candidates: nope" in bad.stderr
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.json").exists()
