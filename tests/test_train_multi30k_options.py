"""benchmarks/train_multi30k.py takes qkv train's own model and training options (declared once, in
qkv.cli.train), and the spellings its README commands were written with still mean what they meant."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import crash_trials
import pytest
from bench_loader import load_benchmark

from qkv.cli.train import MODEL_OPTIONS
from qkv.training import TrainConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("train_multi30k")


def test_every_command_line_training_field_and_translation_model_option_is_accepted(bench):
    flags = []
    for f in fields(TrainConfig):
        if f.metadata.get("cli"):
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            value = {"bool": None, "int": "3", "float": "0.25"}.get(f.type, (f.metadata.get("choices") or ["x"])[0])
            flags += [flag] if value is None else [flag, value]
    for option, (field, _, kind, _) in MODEL_OPTIONS.items():
        if field is not None:
            flag = "--" + option.replace("_", "-")
            flags += [flag] if kind is bool else [flag, {int: "3", float: "0.25", str: "gelu"}[kind]]
    _, model, train = bench.parse_options(flags)
    assert set(model) == {field for field, _, _, _ in MODEL_OPTIONS.values() if field is not None}
    assert set(train) - {"progress"} == {f.name for f in fields(TrainConfig) if f.metadata.get("cli")}


def test_the_readme_spellings_set_the_fields_they_always_set(bench):
    args, model, train = bench.parse_options(
        [
            "--minutes",
            "0",
            "--max-steps",
            "1555",
            "--checkpoint-every-minutes",
            "0",
            "--checkpoint-every-steps",
            "83",
            "--schedule",
            "budget",
            "--decay-fraction",
            "0.3",
            "--warmup",
            "300",
            "--vocab",
            "6000",
            "--layers",
            "4",
            "--d-model",
            "128",
            "--heads",
            "4",
            "--d-ff",
            "256",
            "--dropout",
            "0.2",
            "--lr-factor",
            "0.5",
            "--no-bf16",
            "--src",
            "de",
            "--tgt",
            "en",
            "--threads",
            "1",
        ]
    )
    assert model == {
        "num_encoder_layers": 4,
        "num_decoder_layers": 4,
        "d_model": 128,
        "num_heads": 4,
        "d_ff": 256,
        "dropout": 0.2,
    }
    assert {
        k: train[k]
        for k in (
            "max_minutes",
            "max_steps",
            "checkpoint_every_minutes",
            "checkpoint_every_steps",
            "schedule",
            "decay_fraction",
            "warmup_steps",
            "lr_factor",
            "bf16",
        )
    } == {
        "max_minutes": 0.0,
        "max_steps": 1555,
        "checkpoint_every_minutes": 0.0,
        "checkpoint_every_steps": 83,
        "schedule": "budget",
        "decay_fraction": 0.3,
        "warmup_steps": 300,
        "lr_factor": 0.5,
        "bf16": False,
    }
    assert (args.vocab_size, args.src, args.tgt, args.threads) == (6000, "de", "en", 1)


def test_defaults_leave_the_recipe_alone_except_the_benchmarks_own(bench):
    _, model, train = bench.parse_options([])
    assert model == {}
    assert {k: v for k, v in train.items() if k != "progress"} == {
        "max_minutes": 60.0,
        "seed": 0,
        "eval_sentences": 300,
        "log_every_steps": 10,
    }


def test_explicit_encoder_or_decoder_layers_win_over_layers(bench):
    _, model, _ = bench.parse_options(["--layers", "3", "--encoder-layers", "6"])
    assert (model["num_encoder_layers"], model["num_decoder_layers"]) == (6, 3)


def test_sigterm_saves_the_benchmark_run_and_says_how_to_go_on(tmp_path, multi30k_dir):
    """SIGTERM during the benchmark's training saves the last whole step (as qkv train does), exits 143
    and writes no report; before, the process died on the spot and lost everything since the last
    checkpoint."""
    import signal
    import sys

    data = multi30k_dir
    run, out = tmp_path / "run", tmp_path / "report.json"
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "train_multi30k.py"),
        "--data",
        str(data),
        "--minutes",
        "5",
        "--train-limit",
        "400",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--layers",
        "1",
        "--d-ff",
        "64",
        "--max-tokens",
        "600",
        "--eval-every-minutes",
        "0",
        "--checkpoint-every-minutes",
        "0",
        "--threads",
        "1",
        "--log-every-steps",
        "2",
        "--no-bf16",
        "--run-dir",
        str(run),
        "--out",
        str(out),
    ]
    proc, err, saved, trained = crash_trials.terminate_after_steps(argv, run, 3)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 6 <= trained <= saved, err
    assert f"stopped: checkpoint saved at step {saved}; continue with qkv train --run-dir {run} --resume" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.slow  # minutes of subprocess training and decoding: run with -m slow
def test_the_ensemble_benchmark_trains_members_side_by_side_and_scores_them_together(tmp_path, capsys, multi30k_dir):
    """benchmarks/train_multi30k_ensemble.py: two members (one thread each, seeds 0 and 1) get the
    options it does not know; the length penalty is the validation set's best; the ensemble's scores
    are what qkv evaluate --ensemble gives for the same runs."""
    import json
    import subprocess
    import sys

    from qkv.cli import main

    data = multi30k_dir
    run, out = tmp_path / "ensemble", tmp_path / "report.json"
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "train_multi30k_ensemble.py"),
        "--data",
        str(data),
        "--members",
        "2",
        "--threads",
        "2",
        "--alphas",
        "0.6,2.0",
        "--eval-limit",
        "12",
        "--run-dir",
        str(run),
        "--out",
        str(out),
        "--minutes",
        "0",
        "--max-steps",
        "6",
        "--train-limit",
        "400",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--layers",
        "1",
        "--d-ff",
        "64",
        "--max-tokens",
        "600",
        "--eval-every-minutes",
        "0",
        "--checkpoint-every-minutes",
        "0",
        "--vocab-size",
        "500",
        "--no-bf16",
        "--beam",
        "2",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    members = report["members"]
    assert [(m["seed"], m["steps"], m["threads"]) for m in members] == [(0, 6, 1), (1, 6, 1)]
    for i in range(2):
        member = json.loads((run / f"member{i}.json").read_text())
        assert member["model"]["d_model"] == 32 and member["train"]["seed"] == i
    search = report["decode"]["val_bleu_by_alpha"]
    alpha = report["decode"]["alpha"]
    assert search[str(alpha)] == max(search.values())
    assert report["scores"]["val_beam2"]["bleu"] == search[str(alpha)]
    assert {"val_beam2", "val_beam1", "test_2016_beam2", "test_2016_beam1"} <= set(report["scores"])
    for name in ("val", "test_2016"):  # the scored beam's translations, one line a sentence, beside the members
        assert len((run / f"{name}.hyp.de").read_text(encoding="utf-8").splitlines()) == 12
        assert len((run / "member0" / f"{name}.hyp.de").read_text(encoding="utf-8").splitlines()) == 12
    code = main(
        [
            "evaluate",
            str(run / "member0"),
            "--ensemble",
            str(run / "member1"),
            "--split",
            "test",
            "--limit",
            "12",
            "--beam",
            "2",
            "--alpha",
            str(alpha),
            "--json",
            "--threads",
            "2",
        ]
    )
    assert code == 0
    again = json.loads(capsys.readouterr().out)
    assert again["bleu"] == report["scores"]["test_2016_beam2"]["bleu"]
    assert again["chrf"] == report["scores"]["test_2016_beam2"]["chrf"]
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=600)  # would retrain over the members
    assert rerun.returncode == 2 and "exist: score them with --score-only" in rerun.stderr
    assert json.loads((run / "member0.json").read_text())["steps"] == 6  # untouched
    bad = subprocess.run(
        [*argv[:2], "--run-dir", str(tmp_path / "new"), "--out", str(out), "--alphas", "0.6,x"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "--alphas takes numbers" in bad.stderr and not (tmp_path / "new").exists()
    bad = subprocess.run(
        [*argv[:2], "--run-dir", str(tmp_path / "new"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "--out names a directory" in bad.stderr and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--weight-decay", "-1"], "weight_decay (--weight-decay) must be >= 0"),
        (["--out", "{tmp}"], "--out names a directory"),
        (["--score-only"], "not a qkv run folder"),
    ],
)
def test_bad_options_get_one_line_and_leave_no_run_folder(bench, tmp_path, monkeypatch, capsys, argv, message):
    run_dir = tmp_path / "run"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    monkeypatch.setattr(
        "sys.argv",
        ["train_multi30k.py", "--minutes", "1", "--run-dir", str(run_dir), "--out", str(tmp_path / "out.json"), *argv],
    )
    assert bench.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not run_dir.exists() and not (tmp_path / "out.json").exists()
