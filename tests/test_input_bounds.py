"""Inputs that would destroy data or exhaust memory are refused up front, in one line, touching nothing:
``qkv demo --out`` replaces only its own earlier output, the synthetic corpus generator never leaves
a truncated file under its final name, and counts that size memory allocated up front are bounded."""

from __future__ import annotations

import json
import shutil

import pytest
from bench_loader import load_benchmark
from test_reliability import one_line_error, snapshot, train_args, write_pairs

from qkv.cli import main
from qkv.cli.demo import DEMO_MARKER, check_output_folder, is_demo_folder, mark_output_folder
from qkv.cli.options import MAX_BEAM, MAX_SAMPLES


class _Trained(BaseException):
    """Raised in place of training: the demo got past its checks (no test here trains the demo)."""


@pytest.fixture
def no_training(monkeypatch):
    """``qkv demo`` stops where training would start; the calls it got that far with are listed."""
    calls = []

    def start_run(run_dir, **kwargs):
        calls.append((run_dir, kwargs))
        raise _Trained

    monkeypatch.setattr("qkv.runs.translation.start_run", start_run)
    return calls


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """A user's run folder made by a tiny ``qkv train``."""
    root = tmp_path_factory.mktemp("user")
    src, tgt = write_pairs(root / "data")
    assert main(train_args(src, tgt, root / "run")) == 0
    return root / "run"


def demo(out, capsys):
    code = main(["demo", "--out", str(out), "--minutes", "0.01", "--no-progress"])
    return one_line_error(capsys, "demo", code)


# ----------------------------------------------------------------- qkv demo --out


def test_demo_refuses_a_run_folder_from_qkv_train(tmp_path, capsys, user_run, no_training):
    run = shutil.copytree(user_run, tmp_path / "exp" / "run")
    before = snapshot(tmp_path)
    assert "a qkv run folder" in demo(run, capsys)  # the run folder itself
    assert "did not make" in demo(tmp_path / "exp", capsys)  # the folder holding it: --out/run would replace it
    assert snapshot(tmp_path) == before and not no_training


def test_demo_refuses_a_folder_or_file_it_did_not_make(tmp_path, capsys, no_training):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's notes\n")
    (tmp_path / "file.txt").write_text("a user's file\n")
    # shaped like the demo's output, but with a user's file beside it: not the demo's
    lookalike = tmp_path / "lookalike"
    (lookalike / "run").mkdir(parents=True)
    (lookalike / "summary.json").write_text(json.dumps({"exact_match": 1, "test_dates": 1, "steps": 1, "samples": {}}))
    (lookalike / "thesis.tex").write_text("a user's thesis\n")
    before = snapshot(tmp_path)
    assert "did not make" in demo(mine, capsys)
    assert "not a folder" in demo(tmp_path / "file.txt", capsys)
    assert "which is a file" in demo(tmp_path / "file.txt" / "demo", capsys)
    assert "did not make" in demo(lookalike, capsys)
    assert snapshot(tmp_path) == before and not no_training
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "lookalike", "mine"]


def test_demo_refuses_a_foreign_run_inside_its_own_folder(tmp_path, capsys, user_run, no_training):
    """A run the demo could not have made (here: trained on files, not the date task) is not replaced
    even inside a folder the demo marked."""
    out = tmp_path / "demo"
    mark_output_folder(out)
    shutil.copytree(user_run, out / "run")
    (out / "notes").mkdir()
    (out / "notes" / "keep.txt").write_text("x")
    before = snapshot(out)
    assert "not the demo's run on the date task" in demo(out, capsys)
    (out / "run").rename(out / "elsewhere")
    (out / "run").write_text("a user's file named run\n")
    assert "not a folder" in demo(out, capsys)
    (out / "run").unlink()
    (out / "run").mkdir()
    (out / "run" / "x.txt").write_text("x")
    assert "not a qkv run folder and not empty" in demo(out, capsys)
    shutil.rmtree(out / "run")
    (out / "elsewhere").rename(out / "run")
    assert snapshot(out) == before and not no_training


def test_demo_writes_into_a_new_or_empty_folder_and_marks_it(tmp_path, no_training):
    for out in (tmp_path / "new" / "demo", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        with pytest.raises(_Trained):
            main(["demo", "--out", str(out), "--no-progress"])
        assert (out / DEMO_MARKER).is_file() and is_demo_folder(out)
        assert no_training[-1][0] == out / "run" and no_training[-1][1]["overwrite"] is True


def test_demo_replaces_its_own_earlier_output(tmp_path, user_run, no_training):
    """Run twice, the README's ``qkv demo`` replaces its first output: a marked folder, or one from
    before the mark (only the demo's outputs and a summary.json of the demo's shape)."""
    marked = tmp_path / "marked"
    mark_output_folder(marked)
    run = shutil.copytree(user_run, marked / "run")
    config = json.loads((run / "config.json").read_text())
    config["data"] = {"source": "dates", "train_size": 20000, "valid_size": 1000, "seed": 0}
    (run / "config.json").write_text(json.dumps(config))
    (marked / "heatmaps").mkdir()
    (marked / "heatmaps" / "00-a-cross-attention-layer0.png").write_bytes(b"png")
    (marked / "attention.html").write_text("<html>")
    (marked / "summary.json").write_text("{}")

    unmarked = tmp_path / "unmarked"
    shutil.copytree(marked, unmarked)
    (unmarked / DEMO_MARKER).unlink()
    (unmarked / "summary.json").write_text(
        json.dumps({"exact_match": 0.99, "test_dates": 2000, "steps": 700, "samples": {"3/3/98": "1998-03-03"}})
    )
    for out in (marked, unmarked):
        assert is_demo_folder(out)
        check_output_folder(out)
        with pytest.raises(_Trained):
            main(["demo", "--out", str(out), "--no-progress"])
        assert (out / DEMO_MARKER).is_file() and no_training[-1][0] == out / "run"


# ----------------------------------------------------------------- make_wmt_like writes atomically


def test_the_corpus_generator_never_leaves_a_partial_file_under_its_name(tmp_path, monkeypatch):
    make_wmt_like = load_benchmark("make_wmt_like")
    old = b"an earlier corpus, whole\n"
    (tmp_path / "train.en").write_bytes(old)
    monkeypatch.setitem(make_wmt_like.write_corpus.__kwdefaults__, "chunk", 10)  # several writes a file
    real, calls, seen = make_wmt_like.sentences, [], []

    def sentences(*args):
        calls.append(1)
        if len(calls) == 5:  # the third chunk: two are already written
            seen.append(sorted(p.name for p in tmp_path.iterdir()))
            raise OSError("disk full")  # or a kill -9: nothing after this point runs
        return real(*args)

    monkeypatch.setattr(make_wmt_like, "sentences", sentences)
    argv = ["--pairs", "50", "--valid-pairs", "10", "--vocab", "100", "--out", str(tmp_path), "--overwrite"]
    with pytest.raises(OSError, match="disk full"):
        make_wmt_like.main(argv)
    # mid-write, the half-written data was under temporary names only
    assert [n for n in seen[0] if not n.startswith(".")] == ["train.en"]
    assert any(n.startswith(".train.en.") and n.endswith(".tmp") for n in seen[0])
    assert (tmp_path / "train.en").read_bytes() == old and not (tmp_path / "train.de").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.en"]  # no temporaries left either

    (tmp_path / ".train.de.x1y2.tmp").write_bytes(b"left by a killed run")
    monkeypatch.setattr(make_wmt_like, "sentences", real)
    assert make_wmt_like.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.de", "train.en", "valid.de", "valid.en"]
    assert len((tmp_path / "train.en").read_text().splitlines()) == 50


# ----------------------------------------------------------------- counts that size memory up front


def parse_error(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, limit",
    [
        (["generate", "no-such-model", "--num-samples", "1000000000"], MAX_SAMPLES),
        (["translate", "no-such-run", "--beam", "1000000000"], MAX_BEAM),
        (["evaluate", "no-such-run", "--beam", str(MAX_BEAM + 1)], MAX_BEAM),
    ],
)
def test_counts_that_size_memory_up_front_are_bounded(tmp_path, capsys, argv, limit):
    err = parse_error(capsys, argv)
    assert f"argument {argv[2]}: expected an integer from 1 to {limit}" in err and "memory" in err
    # the limit itself is accepted by the argument checks (what fails next is the missing model)
    assert main([*argv[:3], str(limit)]) == 2
    assert "no-such" in capsys.readouterr().err


def test_a_long_streamed_generation_stays_allowed(capsys):
    """--max-new-tokens allocates nothing up front (the text is streamed): no upper bound."""
    assert main(["generate", "no-such-model", "--max-new-tokens", "1000000000"]) == 2
    assert "model folder not found" in capsys.readouterr().err
