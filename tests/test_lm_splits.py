"""A language model's three splits: a text without ``--val-text`` is cut by position on characters
(90% train, 5% validation, 5% test), ``--val-text``/``--test-text`` give them as files; training,
validation during training and resuming never open the test split; ``qkv evaluate`` scores
validation then test as a plain PyTorch loop does; a run folder made before test splits existed
still resumes and is scored on validation; bad inputs are refused in one line before anything is
written. Every expected value is computed here from the raw text, not read from qkv."""

import json
import math
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.cli import main
from qkv.data.spec import DataSpec
from qkv.data.text import read_text_splits
from qkv.runs.folder import load_run
from qkv.runs.translation import resume_run, run_training, start_run

MODEL = dict(d_model=32, num_heads=2, num_layers=1, d_ff=64, context=16, dropout=0.0)
TRAIN = dict(
    max_steps=4,
    max_minutes=0.0,
    max_tokens=128,
    warmup_steps=2,
    lr_factor=1.0,
    progress=False,
    eval_every_steps=2,
    eval_sentences=4,
    checkpoint_every_minutes=0.0,
    eval_every_minutes=0.0,
    average_last=1,
    log_every_steps=1,
    bf16=False,
)
LINES = ("To be, or not to be", "that is the question", "Whether 'tis nobler in the mind")
# the last line holds characters found nowhere else: they are in the test split alone
TEXT = "".join(f"{LINES[i % 3]}: line {i}.\n" for i in range(300)) + "Zounds! Quixotic jest.\n"
TINY = [
    "--d-model",
    "32",
    "--heads",
    "2",
    "--layers",
    "1",
    "--d-ff",
    "64",
    "--context",
    "16",
    "--max-tokens",
    "128",
    "--max-steps",
    "1",
    "--minutes",
    "0",
    "--no-bf16",
    "--no-progress",
    "--threads",
    "1",
]


def cuts(text: str) -> tuple[int, int]:
    """The documented cut: the first 90% of the characters, the next 5%, the last 5% (rounded down)."""
    return len(text) * 90 // 100, len(text) * 95 // 100


def char_ids(text: str) -> dict:
    """A character vocabulary made here: one id per distinct character, in sorted order."""
    return {c: i for i, c in enumerate(sorted(set(text)))}


def stored(path: Path) -> list[int]:
    return np.fromfile(path, dtype=np.uint16).tolist()  # the uint16 layout, read without qkv


def plain_loss(model, ids: list[int], context: int, windows: int | None = None) -> tuple[float, int]:
    """Summed cross-entropy (nats) and token count over the non-overlapping windows of ``ids``, from
    the model's plain logits (not its fused loss)."""
    tokens = torch.tensor(ids, dtype=torch.long)
    starts = list(range(0, len(tokens) - context, context))[:windows]
    total = 0.0
    with torch.no_grad():
        for start in starts:
            window = tokens[start : start + context + 1]
            logits = model(window[None, :-1]).logits[0]
            total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
    return total, len(starts) * context


def one_line_error(capsys, command: str, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"qkv {command}: error: "), err
    return err[0]


def evaluate_json(capsys, run: Path, *args: str) -> tuple[list[dict], str]:
    capsys.readouterr()
    code = main(["evaluate", str(run), "--json", "--threads", "1", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()], err


@contextmanager
def files_opened():
    """Every path opened (``open``/``os.open``, as np.memmap and np.fromfile do) while the block runs,
    seen through Python's audit events."""
    opened: list[str] = []
    watching[:] = [opened]
    try:
        yield opened
    finally:
        watching[:] = []


watching: list = []


def _audit(event: str, args: tuple) -> None:
    if watching and event == "open" and isinstance(args[0], (str, bytes, Path)):
        watching[0].append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("runs") / "lm"
    torch.manual_seed(0)
    run_training(
        start_run(
            run_dir,
            data=DataSpec(source="text", train_text=str(corpus)),
            model_options=MODEL,
            train_options=TRAIN,
            device="cpu",
        )
    )
    return run_dir


# ------------------------------------------------------------------------------------- where the cuts fall
def test_a_text_is_cut_90_5_5_by_position_and_each_split_stored_apart(run):
    a, b = cuts(TEXT)
    assert 0 <= 0.90 * len(TEXT) - a < 1 and 0 <= 0.95 * len(TEXT) - b < 1
    ids = char_ids(TEXT)  # the character vocabulary covers the test split's characters too
    assert json.loads((run / "tokenizer.json").read_text())["chars"] == "".join(sorted(ids))
    for name, part in (("train", TEXT[:a]), ("val", TEXT[a:b]), ("test", TEXT[b:])):
        assert stored(run / f"{name}.bin") == [ids[c] for c in part], name
    assert "Zounds" in TEXT[b:] and "Z" not in TEXT[:b]
    splits = json.loads((run / "config.json").read_text())["lm"]["splits"]
    assert [splits[k]["chars"] for k in ("train", "val", "test")] == [[0, a], [a, b], [b, len(TEXT)]]
    assert [splits[k]["tokens"] for k in ("train", "val", "test")] == [a, b - a, len(TEXT) - b]


def test_tiny_shakespeare_is_cut_at_the_same_positions(tinyshakespeare_dir):
    text = (tinyshakespeare_dir / "input.txt").read_bytes().decode("utf-8")
    a, b = cuts(text)
    splits = read_text_splits({"source": "tinyshakespeare", "folder": str(tinyshakespeare_dir)})
    assert (splits.train, splits.val, splits.test) == (text[:a], text[a:b], text[b:])
    assert len(splits.val) >= 55_000 and len(splits.test) >= 55_000  # 5% of 1,115,394 characters each


def test_val_text_and_test_text_give_the_splits_as_files(tmp_path, capsys):
    val, test = "Now is the winter of our discontent.\n" * 6, "Friends, Romans, countrymen: lend me your ears.\n" * 6
    for name, text in (("train.txt", TEXT), ("val.txt", val), ("test.txt", test)):
        (tmp_path / name).write_text(text, encoding="utf-8")
    files = ["--train-text", str(tmp_path / "train.txt"), "--val-text", str(tmp_path / "val.txt")]
    assert (
        main(["train", *files, "--test-text", str(tmp_path / "test.txt"), "--run-dir", str(tmp_path / "run"), *TINY])
        == 0
    )
    ids = char_ids(TEXT + val + test)
    for name, part in (("train", TEXT), ("val", val), ("test", test)):  # all of --train-text trains
        assert stored(tmp_path / "run" / f"{name}.bin") == [ids[c] for c in part], name
    scores, _ = evaluate_json(capsys, tmp_path / "run", "--split", "test")
    assert [(s["split"], s["tokens"]) for s in scores] == [("test", (len(test) - 1) // 16 * 16)]

    # --val-text alone: no test split, said so
    assert main(["train", *files, "--run-dir", str(tmp_path / "no_test"), *TINY]) == 0
    assert not (tmp_path / "no_test" / "test.bin").exists()
    assert json.loads((tmp_path / "no_test" / "config.json").read_text())["lm"]["splits"]["test"] is None
    scores, err = evaluate_json(capsys, tmp_path / "no_test")
    assert [s["split"] for s in scores] == ["val"]
    assert "no test split (it was trained with --val-text and no --test-text)" in err
    line = one_line_error(capsys, "evaluate", main(["evaluate", str(tmp_path / "no_test"), "--split", "test"]))
    assert "this run has no test split" in line


# ------------------------------------------------------------------------------ training never sees the test
def test_training_validating_and_resuming_never_open_the_test_split(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    trainer = start_run(
        run_dir,
        data=DataSpec(source="text", train_text=str(corpus)),
        model_options=MODEL,
        train_options={**TRAIN, "max_steps": 2},
        device="cpu",
    )
    written = (run_dir / "test.bin").read_bytes()
    with files_opened() as opened:
        run_training(trainer)
        run_training(resume_run(run_dir, train_options={"max_steps": 4}, device="cpu"))
    assert any(Path(p).name == "val.bin" for p in opened)  # the spy sees what training reads
    assert not [p for p in opened if "test.bin" in Path(p).name]
    assert (run_dir / "test.bin").read_bytes() == written

    # the validation the run logged (early stopping, the best checkpoint) is over the validation split
    a, b = cuts(TEXT)
    model, _, _ = load_run(run_dir, "last")  # the weights of step 4, the last validation
    total, count = plain_loss(model, [char_ids(TEXT)[c] for c in TEXT[a:b]], 16, windows=TRAIN["eval_sentences"])
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in logged if r.get("event") == "valid"][-1]
    assert last["step"] == 4 and last["val_loss"] == pytest.approx(total / count, abs=1e-4)

    with files_opened() as opened:  # the spy would see it: qkv evaluate --split test opens test.bin
        evaluate_json(capsys, run_dir, "--split", "test")
    assert any(Path(p).name == "test.bin" for p in opened)


# ---------------------------------------------------------------------------------------- qkv evaluate
def test_evaluate_scores_validation_then_test_as_a_plain_loop_does(run, capsys):
    scores, err = evaluate_json(capsys, run)
    assert [s["split"] for s in scores] == ["val", "test"] and "note" not in err
    model, _, _ = load_run(run)
    a, b = cuts(TEXT)
    ids = char_ids(TEXT)
    for score, part in zip(scores, (TEXT[a:b], TEXT[b:])):
        total, count = plain_loss(model, [ids[c] for c in part], 16)
        assert score["tokens"] == count and score["loss"] == pytest.approx(total / count, abs=1e-4)
        assert score["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-3)
        assert score["bits_per_char"] == pytest.approx(total / count / math.log(2), abs=1e-4)  # a token a character
    alone, _ = evaluate_json(capsys, run, "--split", "test")
    assert alone == scores[1:]
    assert main(["evaluate", str(run), "--split", "val", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"validation split: {scores[0]['tokens']} tokens") and len(out) == 2


def test_evaluate_refuses_what_a_language_model_run_has_not(run, capsys, tmp_path):
    line = one_line_error(capsys, "evaluate", main(["evaluate", str(run), "--split", "train"]))
    assert "the splits val and test" in line
    (tmp_path / "other.txt").write_text(TEXT[:200], encoding="utf-8")
    line = one_line_error(
        capsys, "evaluate", main(["evaluate", str(run), "--split", "test", "--text", str(tmp_path / "other.txt")])
    )
    assert "either --split or --text" in line
    scores, _ = evaluate_json(capsys, run, "--text", str(tmp_path / "other.txt"))  # --text keeps working
    assert [(s["split"], s["text"]) for s in scores] == [("text", str(tmp_path / "other.txt"))]


# ---------------------------------------------------------------------------- run folders made before
def old_run_folder(run: Path, tmp_path: Path) -> Path:
    """A run folder as qkv wrote it before test splits: no test.bin, no "splits" in config.json."""
    old = tmp_path / "old"
    shutil.copytree(run, old)
    (old / "test.bin").unlink()
    config = json.loads((old / "config.json").read_text())
    del config["lm"]["splits"]
    config["data"].pop("test_text", None)
    (old / "config.json").write_text(json.dumps(config))
    return old


def test_a_run_folder_from_before_test_splits_is_scored_on_validation_and_resumes(run, tmp_path, capsys):
    old = old_run_folder(run, tmp_path)
    scores, err = evaluate_json(capsys, old)
    assert [s["split"] for s in scores] == ["val"]
    assert "note: this run folder was made before qkv kept a test split" in err
    line = one_line_error(capsys, "evaluate", main(["evaluate", str(old), "--split", "test"]))
    assert "made before qkv kept a test split" in line and "--split val" in line
    trainer = resume_run(old, train_options={"max_steps": 6}, device="cpu")
    run_training(trainer)
    assert trainer.state.step == 6 and not (old / "test.bin").exists()


def test_a_damaged_test_array_is_found_on_resume_and_by_evaluate(run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    (damaged / "test.bin").write_bytes((damaged / "test.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="test.bin: .* bytes, but config.json records"):
        resume_run(damaged, device="cpu")
    line = one_line_error(capsys, "evaluate", main(["evaluate", str(damaged), "--split", "test"]))
    assert "test.bin" in line
    (damaged / "test.bin").unlink()
    with pytest.raises(FileNotFoundError, match="test tokens are missing"):
        resume_run(damaged, device="cpu")


# ---------------------------------------------------------------------------------------- bad inputs
def test_bad_test_text_is_refused_in_one_line_before_anything_is_written(corpus, run, tmp_path, capsys):
    (tmp_path / "val.txt").write_text(TEXT[:2000], encoding="utf-8")
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "short.txt").write_text("too short\n", encoding="utf-8")
    train, val = ["--train-text", str(corpus)], ["--val-text", str(tmp_path / "val.txt")]
    for args, message in [
        ([*train, *val, "--test-text", str(tmp_path / "empty.txt")], "empty.txt: the text is empty"),
        ([*train, "--test-text", str(tmp_path / "val.txt")], "--test-text needs --val-text"),
        (["--test-text", str(tmp_path / "val.txt")], "--test-text needs --train-text"),
        ([*train, *val, "--test-text", str(tmp_path / "val.txt")], "the same file as --val-text"),
        ([*train, *val, "--test-text", str(corpus)], "the same file as --train-text"),
        ([*train, *val, "--test-text", str(tmp_path / "short.txt")], "the test text has 10 tokens"),
        ([*train, *val, "--test-text", str(tmp_path / "missing.txt")], "no such text file"),
        (["--data", "tinyshakespeare", "--test-text", str(tmp_path / "val.txt")], "give one of"),
    ]:
        code = main(["train", *args, "--run-dir", str(tmp_path / "run"), *TINY])
        assert message in one_line_error(capsys, "train", code), args
        assert not (tmp_path / "run").exists()
    code = main(["train", "--run-dir", str(run), "--resume", "--test-text", str(tmp_path / "val.txt")])
    assert "--test-text: a resumed run keeps the model and data" in one_line_error(capsys, "train", code)
