"""benchmarks/recipe_sweep.py --collect: hour-long runs gathered into one validation-only table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def test_collect_names_each_run_by_what_it_changed_and_keeps_validation_only(tmp_path):
    reference = RESULTS / "multi30k" / "multi30k_en_de_xeon_bf16.json"
    candidate = RESULTS / "multi30k" / "multi30k_en_de_xeon_bf16_dropout03.json"
    out = tmp_path / "sweep.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "recipe_sweep.py"),
            "--collect",
            str(reference),
            str(candidate),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.read_text())
    rows = report["candidates"]
    assert list(rows) == ["reference", "dropout 0.3"]  # the only field the candidate's run changed
    assert rows["dropout 0.3"]["changes"] == {"model.dropout": 0.3}
    for name, path in (("reference", reference), ("dropout 0.3", candidate)):
        run = json.loads(path.read_text())
        row = rows[name]
        assert row["val_bleu_beam5"] == run["scores"]["averaged"]["val_beam5"]["bleu"]
        assert row["steps"] == run["steps"] and row["minutes_trained"] == round(run["train_wall_seconds"] / 60, 1)
        assert [b for _, b in row["val_bleu_greedy_300_vs_minutes"]] == [
            c["val_bleu_greedy_300"] for c in run["bleu_vs_minutes"]
        ]
    assert "test" not in json.dumps(rows)  # test 2016 never enters the table that chooses
    assert out.with_suffix(".png").stat().st_size > 1000


def test_collect_refuses_a_file_that_is_not_a_run_report_and_writes_nothing(tmp_path):
    (tmp_path / "other.json").write_text("{}")
    out = tmp_path / "sweep.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "recipe_sweep.py"),
            "--collect",
            str(tmp_path / "other.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--collect" in done.stderr.strip().splitlines()[-1]
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_a_field_newer_than_the_reference_counts_only_where_it_differs_from_its_default(tmp_path):
    # the reference was written before ema_decay and subword_dropout existed
    reference = RESULTS / "multi30k" / "multi30k_en_de_xeon_bf16.json"
    candidate = RESULTS / "multi30k" / "multi30k_en_de_xeon_bf16_subword_dropout01.json"  # ema_decay 0, subword 0.1
    assert "ema_decay" not in json.loads(reference.read_text())["train"]
    out = tmp_path / "sweep.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "recipe_sweep.py"),
            "--collect",
            str(reference),
            str(candidate),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    changes = list(json.loads(out.read_text())["candidates"].values())[1]["changes"]
    assert changes["train.subword_dropout"] == 0.1 and "train.ema_decay" not in changes


def test_two_runs_of_the_same_settings_keep_a_row_each(tmp_path):
    """Seeds, machines and dates are not settings: two such runs used to share a name and the second
    silently replaced the first in the table."""
    reference = RESULTS / "multi30k" / "ensembles" / "multi30k_en_de_epyc_zen5_bf16_ensemble2_member0.json"
    # seed 1, otherwise the same
    again = RESULTS / "multi30k" / "ensembles" / "multi30k_en_de_epyc_zen5_bf16_ensemble2_member1.json"
    out = tmp_path / "sweep.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "recipe_sweep.py"),
            "--collect",
            str(reference),
            str(again),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = json.loads(out.read_text())["candidates"]
    assert list(rows) == ["reference", f"reference ({again.name})"]
    assert [r["val_bleu_beam5"] for r in rows.values()] == [
        json.loads(p.read_text())["scores"]["averaged"]["val_beam5"]["bleu"] for p in (reference, again)
    ]
