"""The translation commands end to end through ``qkv.cli.main``: train (dates and files), resume,
translate (stdin and a file), evaluate, and one-line errors for bad input."""

import gzip
import io
import json
import sys

import pytest

from qkv.cli import main
from qkv.data.dates import generate_dates

TINY = [
    "--d-model",
    "32",
    "--heads",
    "2",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "1",
    "--d-ff",
    "64",
    "--max-tokens",
    "800",
    "--no-progress",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def dates_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "dates"
    code = main(
        [
            "train",
            "--data",
            "dates",
            "--run-dir",
            str(run_dir),
            "--max-steps",
            "20",
            "--minutes",
            "0",
            "--eval-every-steps",
            "10",
            "--eval-sentences",
            "30",
            *TINY,
        ]
    )
    assert code == 0
    return run_dir


def test_train_writes_a_complete_run_folder(dates_run):
    names = {p.name for p in dates_run.iterdir()}
    assert {
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "last.safetensors",
        "best.safetensors",
        "state.pt",
        "metrics.jsonl",
        "curves.png",
        "checkpoints",
    } <= names
    config = json.loads((dates_run / "config.json").read_text())
    assert config["data"]["source"] == "dates" and config["model"]["d_model"] == 32
    assert config["train"]["max_steps"] == 20 and config["model"]["norm_first"] is True  # the dates recipe
    events = [json.loads(line) for line in (dates_run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "valid"] == [10, 20]
    assert (dates_run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_translate_stdin_and_file(dates_run, tmp_path, monkeypatch, capsys):
    lines = ["3 March 1998", "12/25/04", "the first of May, 2010"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    assert main(["translate", str(dates_run), "--beam", "1"]) == 0
    greedy = capsys.readouterr().out.splitlines()
    assert len(greedy) == 3
    source = tmp_path / "in.txt.gz"
    with gzip.open(source, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    assert main(["translate", str(dates_run), str(source), "--beam", "1", "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8").splitlines() == greedy
    assert main(["translate", str(dates_run), str(source), "--beam", "4", "--weights", "best"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_evaluate_split_and_files(dates_run, tmp_path, capsys):
    assert main(["evaluate", str(dates_run), "--split", "test", "--limit", "40", "--beam", "2", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["sentences"] == 40 and "tok:13a" in scores["bleu_signature"] and 0 <= scores["bleu"] <= 100
    assert scores["bf16"] is False  # the JSON says which precision decoded (a benchmark decodes as its run trained)
    pairs = generate_dates(10, seed=9, split="test")
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    ref.write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    hyp = tmp_path / "hyp.txt"
    assert (
        main(["evaluate", str(dates_run), "--src", str(src), "--ref", str(ref), "--beam", "1", "--hyp-out", str(hyp)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "BLEU" in printed and "chrF" in printed and "nrefs:1|case:mixed" in printed
    assert len(hyp.read_text().splitlines()) == 10


def test_evaluate_and_translate_decode_as_the_run_says(dates_run, tmp_path, capsys):
    """A run keeps its recipe's beam and length penalty in config.json; evaluate and translate use
    them unless --beam/--alpha say otherwise (checked against translate_texts called directly)."""
    from qkv.decoding.translate import translate_texts
    from qkv.runs.folder import load_run
    from qkv.runs.recipes import DEFAULT_DECODE, RECIPES

    config = json.loads((dates_run / "config.json").read_text())
    assert config["decode"] == {**DEFAULT_DECODE, **RECIPES["dates"].get("decode", {})}
    run = tmp_path / "run"
    run.mkdir()
    for item in dates_run.iterdir():
        if item.is_file():
            (run / item.name).write_bytes(item.read_bytes())
    config["decode"] = {"beam_size": 3, "alpha": 2.5}
    (run / "config.json").write_text(json.dumps(config))
    pairs = generate_dates(12, seed=5, split="test")
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    ref.write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    model, tokenizer, _ = load_run(run, "model")
    for options, beam, alpha in (([], 3, 2.5), (["--beam", "1"], 1, 2.5), (["--alpha", "0"], 3, 0.0)):
        hyp = tmp_path / "hyp.txt"
        assert (
            main(
                ["evaluate", str(run), "--src", str(src), "--ref", str(ref), "--json", "--hyp-out", str(hyp), *options]
            )
            == 0
        )
        scores = json.loads(capsys.readouterr().out)
        assert (scores["beam"], scores["alpha"]) == (beam, alpha)
        expected = translate_texts(model, tokenizer, pairs.src, beam_size=beam, alpha=alpha)
        assert hyp.read_text(encoding="utf-8").splitlines() == expected
        assert main(["translate", str(run), str(src), *options]) == 0
        assert capsys.readouterr().out.splitlines() == expected


def test_resume_continues_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "--data", "dates", "--run-dir", str(run_dir), "--minutes", "0", *TINY]
    assert main([*args, "--max-steps", "4"]) == 0
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--max-steps", "7", "--no-progress"]) == 0
    state = json.loads(json.dumps(__import__("torch").load(run_dir / "state.pt", weights_only=True)["train_state"]))
    assert state["step"] == 7
    capsys.readouterr()
    assert main([*args, "--max-steps", "4"]) == 2  # exists: refuse, do not overwrite
    assert "run folder exists" in capsys.readouterr().err


def test_train_on_files(tmp_path):
    pairs = generate_dates(80, seed=4)
    files = {}
    for name, lines in (
        ("train.src", pairs.src[:60]),
        ("train.tgt", pairs.tgt[:60]),
        ("val.src", pairs.src[60:]),
        ("val.tgt", pairs.tgt[60:]),
    ):
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--train-src",
            str(files["train.src"]),
            "--train-tgt",
            str(files["train.tgt"]),
            "--val-src",
            str(files["val.src"]),
            "--val-tgt",
            str(files["val.tgt"]),
            "--run-dir",
            str(run_dir),
            "--vocab-size",
            "300",
            "--max-steps",
            "3",
            "--minutes",
            "0",
            "--eval-every-steps",
            "3",
            "--no-bf16",
            *TINY,
        ]
    )
    assert code == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["train_src"] == str(files["train.src"].resolve())
    assert main(["evaluate", str(run_dir), "--beam", "1", "--json"]) == 0  # default split: val


@pytest.mark.parametrize(
    "case, expected",
    [
        ("misaligned", "misaligned parallel files"),
        ("empty", "tgt.txt: file is empty"),
        ("latin1", "tgt.txt, line 2: not valid UTF-8"),
        ("missing", "nope.txt: no such file"),
    ],
)
def test_bad_data_one_line_error_and_no_run_folder(tmp_path, capsys, case, expected):
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("a\nb\n", encoding="utf-8")
    tgt.write_bytes(
        {"misaligned": b"A\n", "empty": b"", "latin1": "A\nGr\u00fc\u00dfe\n".encode("latin-1"), "missing": b"A\nB\n"}[
            case
        ]
    )
    train_src = tmp_path / "nope.txt" if case == "missing" else src
    code = main(
        ["train", "--train-src", str(train_src), "--train-tgt", str(tgt), "--run-dir", str(tmp_path / "run"), *TINY]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err and err.startswith("qkv train: error:") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.txt", "tgt.txt"]


def test_usage_errors(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "r")]) == 2
    assert "no training data" in capsys.readouterr().err
    assert main(["train", "--data", "dates", "--train-src", "x", "--run-dir", str(tmp_path / "r")]) == 2
    assert main(["translate", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert not (tmp_path / "r").exists() and not (tmp_path / "none").exists()
