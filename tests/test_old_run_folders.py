"""Run folders made by qkv 0.1.0 (``tests/fixtures/runs_v0_1``, committed as that version wrote them)
keep working with today's code: they load, translate or generate, evaluate and resume.

Each test works on a copy, so the fixture itself is never changed.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from qkv.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"


@pytest.fixture
def old_run(tmp_path):
    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURES / name, target)
        return target

    return copy


def test_the_fixtures_are_as_qkv_0_1_wrote_them():
    """The premise: the folders hold the 0.1.0 format (run format 2 with every training option of that
    version, R-Drop and late dropout among them), not something rewritten by later code."""
    for name in ("translation_run", "lm_run"):
        config = json.loads((FIXTURES / name / "config.json").read_text())
        assert config["qkv_run"] == 2
        assert {"rdrop", "rdrop_start", "dropout_start", "both_directions_until", "subword_dropout"} <= set(
            config["train"]
        )
        assert "recipe" not in config  # 0.1.0 did not record the recipe


def test_an_old_translation_run_loads_with_its_weights(old_run):
    from safetensors.torch import load_file

    from qkv.runs.folder import load_run

    folder = old_run("translation_run")
    model, tokenizer, config = load_run(folder)
    assert tokenizer.vocab_size == config["model"]["src_vocab_size"] == 300
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key


def test_an_old_translation_run_translates_and_evaluates(old_run, tmp_path, capsys):
    folder = old_run("translation_run")
    lines = tmp_path / "in.en"
    lines.write_text("A man is riding a bike .\nTwo dogs play in the snow .\n")
    out = tmp_path / "out.de"
    assert main(["translate", str(folder), str(lines), "-o", str(out), "--beam", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    refs = tmp_path / "ref.de"
    refs.write_text("Ein Mann fährt Fahrrad .\nZwei Hunde spielen im Schnee .\n")
    capsys.readouterr()
    assert main(["evaluate", str(folder), "--src", str(lines), "--ref", str(refs), "--beam", "2", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert "bleu" in json.dumps(scores).lower()


def test_an_old_translation_run_resumes(old_run):
    folder = old_run("translation_run")
    assert main(["train", "--run-dir", str(folder), "--resume", "--max-steps", "8", "--no-progress"]) == 0
    state = torch.load(folder / "state.pt", weights_only=True)
    assert state["train_state"]["step"] == 8
    config = json.loads((folder / "config.json").read_text())
    assert config["train"]["max_steps"] == 8


def test_an_old_language_model_generates_evaluates_and_resumes(old_run, capsys):
    folder = old_run("lm_run")
    assert main(["generate", str(folder), "--prompt", "ROMEO:", "--max-new-tokens", "10", "--seed", "0"]) == 0
    assert "ROMEO:" in capsys.readouterr().out
    assert main(["evaluate", str(folder), "--json"]) == 0
    scores = capsys.readouterr().out
    assert "bits" in scores
    assert main(["train", "--run-dir", str(folder), "--resume", "--max-steps", "8", "--no-progress"]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["train"]["max_steps"] == 8
