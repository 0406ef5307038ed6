"""Nothing lost under bad input and crashes: one test per defect found by a hostile new user
(each failed before the fix), through the CLI's Python entry point ``qkv.cli.main``.

A CLI error must be one line ``qkv <command>: error: ...`` with exit code 2 (bad input) or 1 (a
fault), never a traceback, and must leave every file it did not create as it was.
"""

import io
import json
import os
import sys

import pytest
import torch

from qkv.cli import main
from qkv.data.dates import generate_dates
from qkv.data.spec import DataSpec

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
    "600",
    "--no-progress",
    "--threads",
    "1",
    "--vocab-size",
    "300",
]


def snapshot(folder):
    """Every file under ``folder`` with its bytes (to prove nothing was deleted or changed)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys, command, code, expected_code=2):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"qkv {command}: error:")]
    assert code == expected_code, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def write_pairs(folder, n=60, seed=4, name="train"):
    pairs = generate_dates(n, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.src").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (folder / f"{name}.tgt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    return folder / f"{name}.src", folder / f"{name}.tgt"


def train_args(src, tgt, run_dir, *extra):
    return [
        "train",
        "--train-src",
        str(src),
        "--train-tgt",
        str(tgt),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "2",
        "--minutes",
        "0",
        "--no-bf16",
        *TINY,
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished two-step run on files: (its folder, the training files)."""
    root = tmp_path_factory.mktemp("trained")
    src, tgt = write_pairs(root / "data")
    assert main(train_args(src, tgt, root / "run", "--average-last", "1")) == 0
    return root / "run", (src, tgt)


def copy_run(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "run")


# ----------------------------------------------------------------- 1. --overwrite deletes what it names
def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys, monkeypatch):
    src, tgt = write_pairs(tmp_path / "work")
    (tmp_path / "work" / "notes.txt").write_text("my thesis", encoding="utf-8")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path / "work")
    code = main(train_args(src, tgt, ".", "--overwrite"))
    assert "not a qkv run folder" in one_line_error(capsys, "train", code)
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_run_folder_holding_the_training_files(tmp_path, capsys, trained):
    run = copy_run(trained[0], tmp_path)
    src, tgt = write_pairs(run / "mydata")  # a run folder that now also holds the new run's data
    before = snapshot(tmp_path)
    code = main(train_args(src, tgt, run, "--overwrite"))
    assert "the new run reads this file" in one_line_error(capsys, "train", code)
    assert snapshot(tmp_path) == before


def test_overwrite_with_a_bad_option_keeps_the_old_run(tmp_path, capsys, trained):
    run = copy_run(trained[0], tmp_path)
    src, tgt = trained[1]
    before = snapshot(run)
    code = main(train_args(src, tgt, run, "--overwrite", "--dropout", "1.5"))
    assert "dropout must be in [0, 1)" in one_line_error(capsys, "train", code)
    assert snapshot(run) == before


def test_overwrite_replaces_a_run_folder(tmp_path, trained):
    run = copy_run(trained[0], tmp_path)
    src, tgt = trained[1]
    old_config = json.loads((run / "config.json").read_text())
    assert main(train_args(src, tgt, run, "--overwrite", "--d-ff", "32")) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["qkv_run"] and config["model"]["d_ff"] == 32 != old_config["model"]["d_ff"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-made or old folder left


# ----------------------------------------------------------------- 2. one over-long sentence
def test_an_over_long_line_is_dropped_with_its_file_and_line(tmp_path, capsys, caplog):
    src, tgt = write_pairs(tmp_path / "data", n=40)
    lines = src.read_text(encoding="utf-8").splitlines()
    lines[6] = "word " * 20_000  # 100k characters on line 7
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    with caplog.at_level("WARNING"):
        # max-tokens larger than the long line, so an unfiltered run meets it as soon as it is batched
        assert main(train_args(src, tgt, run, "--max-len", "64", "--max-steps", "6", "--max-tokens", "30000")) == 0
    assert f"{src}:7" in caplog.text and "dropped 1 of 40 training pairs" in caplog.text
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "8", "--no-progress"]) == 0
    assert torch.load(run / "state.pt", weights_only=True)["train_state"]["step"] == 8


# ----------------------------------------------------------------- 3. weights and state from different steps
class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs (not even ``except Exception`` handlers)."""


def test_a_kill_between_checkpoint_files_never_mixes_steps(tmp_path, monkeypatch):
    from qkv.runs.translation import resume_run, start_run

    src, tgt = write_pairs(tmp_path / "data", n=80)
    spec = DataSpec(source="files", train_src=str(src), train_tgt=str(tgt), val_src=None, val_tgt=None)
    model = dict(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64)
    # the paper's schedule: the run below changes max_steps (3, then 4, then 6), which would move a
    # budget schedule's rate (it falls to zero at max_steps) and so the weights, kill or no kill
    options = dict(
        max_steps=6, max_tokens=300, progress=False, average_last=1, label_smoothing=0.1, schedule="inverse_sqrt"
    )

    def fresh(name):
        torch.manual_seed(0)
        return start_run(
            tmp_path / name, data=spec, model_options=model, vocab_size=300, train_options=options, device="cpu"
        )

    full = fresh("full")
    full.train()
    expected = {k: v.clone() for k, v in full.model.state_dict().items()}

    killed = fresh("killed")
    killed.config.max_steps = 3
    killed.train()  # a whole checkpoint at step 3
    killed.config.max_steps = 4  # one more step, then the final save: killed after its first file lands
    replace, calls = os.replace, {"n": 0}

    def replace_then_die(a, b):
        replace(a, b)
        calls["n"] += 1
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace_then_die)
        with pytest.raises(Killed):
            killed.train()
    assert calls["n"] == 1
    (tmp_path / "killed" / ".state.pt.abc123.tmp").write_bytes(b"left by a killed writer")
    torch.manual_seed(456)
    again = resume_run(tmp_path / "killed", train_options={"max_steps": 6}, device="cpu")
    assert not list((tmp_path / "killed").rglob("*.tmp"))
    again.train()
    assert again.state.step == 6
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


# ----------------------------------------------------------------- 4. options checked after the folder is made
@pytest.mark.parametrize(
    "option, message",
    [
        (["--dropout", "1.5"], "dropout must be in [0, 1)"),
        (["--attention-dropout", "1"], "attention_dropout must be in [0, 1)"),
        (["--max-tokens", "0"], "max_tokens (--max-tokens) must be >= 1"),
        (["--eval-sentences", "0"], "eval_sentences (--eval-sentences) must be >= 1"),
        (["--accum-steps", "0"], "accum_steps (--accum-steps) must be >= 1"),
        (["--device", "cuda"], "CUDA is not available"),
    ],
)
def test_bad_options_write_nothing(tmp_path, capsys, option, message):
    if option[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src, tgt = write_pairs(tmp_path / "data")
    code = main(train_args(src, tgt, tmp_path / "run", *option))
    assert message in one_line_error(capsys, "train", code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_both_directions_is_refused_where_it_means_nothing(tmp_path, capsys, trained):
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be\n" * 50, encoding="utf-8")
    code = main(["train", "--train-text", str(text), "--run-dir", str(tmp_path / "lm"), "--both-directions"])
    assert "--both-directions is for translation from text" in one_line_error(capsys, "train", code)
    code = main(["train", "--run-dir", str(trained[0]), "--resume", "--both-directions"])
    assert "--both-directions: a resumed run keeps the model and data it started with" in one_line_error(
        capsys, "train", code
    )
    assert not (tmp_path / "lm").exists()


# ----------------------------------------------------------------- 5. tracebacks instead of one-line errors
def test_damaged_run_files_give_one_line_errors(tmp_path, capsys, trained, monkeypatch):
    run = copy_run(trained[0], tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"3 March 1998\n")))
    weights = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert "model.safetensors" in one_line_error(capsys, "translate", main(["translate", str(run)]))
    assert "model.safetensors" in one_line_error(capsys, "evaluate", main(["evaluate", str(run), "--limit", "3"]))
    (run / "model.safetensors").write_bytes(weights)

    config = json.loads((run / "config.json").read_text())
    good_config = json.dumps(config)
    config["model"]["d_ff"] = 48  # sizes that do not match the weights
    (run / "config.json").write_text(json.dumps(config))
    assert "do not belong together" in one_line_error(capsys, "translate", main(["translate", str(run)]))
    (run / "config.json").write_text(good_config)

    (run / "tokenizer.json").write_bytes(b"\x00garbage{")
    assert "tokenizer.json" in one_line_error(capsys, "translate", main(["translate", str(run)]))


@pytest.mark.parametrize(
    "option, message",
    [
        (["--heads", "0"], "num_heads must be a positive integer"),
        (["--threads", "-1"], "--threads"),
        (["--accum-steps", "0"], "accum_steps (--accum-steps) must be >= 1"),
    ],
)
def test_bad_numbers_are_one_line_errors(tmp_path, capsys, option, message):
    src, tgt = write_pairs(tmp_path / "data")
    try:
        code = main(train_args(src, tgt, tmp_path / "run", *option))
    except SystemExit as exit_:  # argparse rejects a malformed value before qkv runs
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_translate_output_naming_a_directory_fails_before_translating(tmp_path, capsys, trained, monkeypatch):
    import qkv.decoding.translate

    calls = []
    monkeypatch.setattr(qkv.decoding.translate, "translate_texts", lambda *a, **k: calls.append(1) or [])
    source = tmp_path / "in.txt"
    source.write_text("3 March 1998\n", encoding="utf-8")
    (tmp_path / "outdir").mkdir()
    code = main(["translate", str(trained[0]), str(source), "-o", str(tmp_path / "outdir")])
    assert "directory" in one_line_error(capsys, "translate", code) and not calls


def test_embed_rejects_non_utf8_stdin_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("caf\u00e9\nna\u00efve\n".encode("latin-1"))))
    code = main(["embed", "--input", "-"])
    assert "<stdin>, line 1: not valid UTF-8" in one_line_error(capsys, "embed", code)


# ----------------------------------------------------------------- 6. nonsense accepted silently
@pytest.mark.parametrize(
    "option, message",
    [
        (["--minutes", "-5"], "max_minutes (--minutes) must be >= 0"),
        (["--max-steps", "-1"], "max_steps (--max-steps) must be >= 0"),
    ],
)
def test_negative_budgets_are_refused(tmp_path, capsys, option, message):
    src, tgt = write_pairs(tmp_path / "data")
    code = main(train_args(src, tgt, tmp_path / "run", *option))
    assert message in one_line_error(capsys, "train", code)
    assert not (tmp_path / "run").exists()


def test_evaluate_negative_limit_is_refused(capsys, trained):
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", str(trained[0]), "--limit", "-1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--limit" in err and len(err.strip().splitlines()) == 1


def test_model_options_on_resume_are_refused(tmp_path, capsys, trained):
    run = copy_run(trained[0], tmp_path)
    before = snapshot(run)
    code = main(["train", "--run-dir", str(run), "--resume", "--max-len", "512", "--max-steps", "4", "--no-progress"])
    assert "--max-len" in one_line_error(capsys, "train", code)
    assert snapshot(run) == before


def test_resume_on_changed_training_data_is_refused(tmp_path, capsys):
    src, tgt = write_pairs(tmp_path / "data", n=60)
    run = tmp_path / "run"
    assert main(train_args(src, tgt, run)) == 0
    for path in (src, tgt):  # 60 pairs become 20
        path.write_text("\n".join(path.read_text(encoding="utf-8").splitlines()[:20]) + "\n", encoding="utf-8")
    capsys.readouterr()
    before = snapshot(run)
    code = main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4", "--no-progress"])
    assert "training data changed" in one_line_error(capsys, "train", code)
    assert snapshot(run) == before


def test_resume_after_the_training_text_is_gone_reads_the_runs_own_copy(tmp_path, capsys):
    src, tgt = write_pairs(tmp_path / "data", n=60)
    run = tmp_path / "run"
    assert main(train_args(src, tgt, run)) == 0
    src.unlink()
    tgt.unlink()
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4", "--no-progress"]) == 0
    assert "trained 4 steps" in capsys.readouterr().err


def test_a_missing_data_dir_is_an_error_not_a_download(tmp_path, capsys, monkeypatch):
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("tried to download"))
    code = main(
        [
            "train",
            "--data",
            "multi30k",
            "--data-dir",
            str(tmp_path / "nope"),
            "--run-dir",
            str(tmp_path / "run"),
            "--max-steps",
            "1",
        ]
    )
    assert "nope" in one_line_error(capsys, "train", code)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------- a crash inside a step
def test_a_failing_step_saves_the_last_whole_step_and_says_how_to_resume(tmp_path, capsys, monkeypatch):
    from qkv.models.transformer import Transformer

    src, tgt = write_pairs(tmp_path / "data", n=60)
    run = tmp_path / "run"
    original, calls = Transformer.loss, {"n": 0}

    def loss_that_fails_on_call_4(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated out of memory")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "loss", loss_that_fails_on_call_4)
    code = main(train_args(src, tgt, run, "--max-steps", "6"))
    line = one_line_error(capsys, "train", code, expected_code=1)
    assert "simulated out of memory" in line and "--resume" in line
    assert torch.load(run / "state.pt", weights_only=True)["train_state"]["step"] == 3
    monkeypatch.setattr(Transformer, "loss", original)
    assert main(["train", "--run-dir", str(run), "--resume", "--no-progress"]) == 0
    assert torch.load(run / "state.pt", weights_only=True)["train_state"]["step"] == 6


def test_an_absurd_length_penalty_is_refused_not_an_overflow(capsys, trained):
    """Found by tests/test_cli_fuzz.py: --alpha 1e9 overflowed inside beam search (exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        main(["translate", str(trained[0]), "--alpha", "1e9"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--alpha" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------- damaged JSON, one reader
@pytest.mark.parametrize(
    "damage", [b'{"model": {"d_model": 3', '{"model": "caf\u00e9"}'.encode("latin-1"), b"\xff\xfe"]
)
def test_every_json_reader_names_a_damaged_file_in_one_line(tmp_path, damage):
    """Run configs, prepared manifests and checkpoint configs are read by qkv.runtime.fileio.read_json: a
    file cut short or not UTF-8 is a ValueError naming it, on one line."""
    from qkv.cli.generate import open_language_model
    from qkv.data.prepared import PreparedCorpus
    from qkv.pretrained import load_pretrained, read_config_dict
    from qkv.runs.folder import read_run_config
    from qkv.runtime.fileio import read_json
    from qkv.viz.explorers import open_explorer

    (tmp_path / "config.json").write_bytes(damage)
    (tmp_path / "manifest.json").write_bytes(damage)
    readers = {
        "config.json": [
            read_run_config,
            read_config_dict,
            load_pretrained,
            open_explorer,
            open_language_model,
            lambda folder: read_json(folder / "config.json"),
        ],
        "manifest.json": [PreparedCorpus],
    }
    for name, calls in readers.items():
        for read in calls:
            with pytest.raises(ValueError) as err:
                read(tmp_path)
            message = str(err.value)
            assert message.startswith(f"{tmp_path / name}: not valid JSON (") and "\n" not in message, message


def test_overwrite_refuses_a_run_folder_holding_a_users_file(tmp_path, capsys, trained):
    """A run folder with a file of the user's in it (notes beside the run) is not replaced whole:
    ``--overwrite`` would delete the notes with the run."""
    run = copy_run(trained[0], tmp_path)
    (run / "notes.txt").write_text("what I tried", encoding="utf-8")
    src, tgt = trained[1]
    before = snapshot(tmp_path)
    code = main(train_args(src, tgt, run, "--overwrite"))
    assert "holds notes.txt, which no qkv run writes" in one_line_error(capsys, "train", code)
    assert snapshot(tmp_path) == before
