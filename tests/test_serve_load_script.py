"""benchmarks/serve_load.py, tiny settings: the generation mode's report (fields and counts, not timings),
the GPT-2 folder --make-gpt2 writes (read back by transformers and tokenizers), its option errors, and
(slow) the translation mode."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "serve_load.py"
FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
LM_CHARS = set(json.loads((FIXTURES / "lm_run" / "tokenizer.json").read_text())["chars"])
WORDS = ("the", "king", "my", "lord", "good", "sir", "what", "shall", "we", "do", "with", "him", "now", "thou", "a")
MAX_TOKENS = 12


def load_script():
    """The script as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_shakespeare(root: Path) -> Path:
    """A made-up tiny Shakespeare in ``root/tinyshakespeare/input.txt``: speakers' names and lines of
    words whose characters the character-level fixture run knows."""
    rng = random.Random(0)
    lines = []
    for i in range(400):
        lines += [f"{rng.choice(['ROMEO', 'JULIET', 'First Citizen'])}:", " ".join(rng.choices(WORDS, k=8)) + "."]
        if i % 5 == 4:
            lines.append("")
    text = "\n".join(lines) + "\n"
    assert set(text) <= LM_CHARS
    (root / "tinyshakespeare").mkdir(parents=True)
    (root / "tinyshakespeare" / "input.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One run of the generation mode: the character LM fixture and a tiny --make-gpt2 folder, continuous
    and one at a time (the --workers mode is the same phases on another server: tests/test_serve_processes.py
    starts --workers 2)."""
    root = tmp_path_factory.mktemp("serve_load")
    env = dict(os.environ, QKV_DATA=str(write_shakespeare(root / "data")), QKV_CACHE=str(root / "cache"))
    out, gpt2 = root / "out.json", root / "gpt2"
    command = [sys.executable, str(SCRIPT), "--endpoint", "generate", "--model", str(FIXTURES / "lm_run")]
    command += ["--make-gpt2", str(gpt2), "--gpt2-layers", "2", "--gpt2-width", "64", "--gpt2-vocab", "512"]
    command += ["--clients", "1,2", "--requests-per-client", "2", "--min-requests", "3"]
    command += ["--max-tokens", str(MAX_TOKENS), "--workers", "1", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), gpt2, done


def test_generate_report_fields(generated):
    report, gpt2, _ = generated
    for field in ("machine", "command", "date", "commit"):  # the house's provenance
        assert report[field], field
    assert report["command"].startswith("python ") and "--endpoint generate" in report["command"]
    assert report["clients"] == [1, 2] and report["workers"] == [1] and report["max_tokens"] == MAX_TOKENS
    assert report["requests_per_phase"] == {"1": 3, "2": 4}
    assert "tiny Shakespeare" in report["prompts"]
    assert [m["model"] for m in report["models"]] == [str(FIXTURES / "lm_run"), str(gpt2.resolve())]
    assert report["models"][0]["config"]["kind"] == "lm" and report["models"][0]["config"]["vocab_size"] == 58
    assert report["models"][1]["config"] == {"kind": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 1, "vocab_size": 512}


def test_generate_phases_count_every_token(generated):
    report, _, _ = generated
    expected = [("continuous", 1), ("one_at_a_time", 1)]
    for entry, is_char_lm in zip(report["models"], (True, False)):
        found = [(p["mode"], p["workers"], p["clients"]) for p in entry["phases"]]
        assert found == [(mode, workers, c) for mode, workers in expected for c in (1, 2)]
        for phase in entry["phases"]:
            n = report["requests_per_phase"][str(phase["clients"])]
            assert phase["requests"] == phase["ok"] == n and phase["failed"] == 0 and phase["failures"] == []
            if is_char_lm:  # no end-of-text token, no stop text: every request runs to max_tokens
                assert phase["tokens"] == n * MAX_TOKENS
            else:  # a random GPT-2 may sample <|endoftext|>
                assert 0 < phase["tokens"] <= n * MAX_TOKENS
            assert phase["wall_s"] > 0 and phase["tokens_per_s"] == pytest.approx(
                phase["tokens"] / phase["wall_s"], 0.01
            )
            for key in ("time_to_first_token_s", "time_per_output_token_s"):
                assert 0 <= phase[key]["p50"] <= phase[key]["p99"] < phase["wall_s"], key
        ratios = entry["ratio_continuous_over_one_at_a_time"]
        assert set(ratios) == {"1", "2"} and all(r is not None and r > 0 for r in ratios.values())
        assert entry["skipped"] == []


def test_make_gpt2_folder_reads_back(generated):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    _, gpt2, _ = generated
    config = transformers.GPT2Config.from_pretrained(str(gpt2))
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size) == (2, 64, 1, 512)
    assert config.eos_token_id == config.bos_token_id == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(str(gpt2))
    assert model.transformer.wte.weight.shape == (512, 64)
    bpe = Tokenizer.from_file(str(gpt2 / "tokenizer.json"))
    assert bpe.get_vocab_size() == 512 and bpe.token_to_id("<|endoftext|>") == 0
    assert bpe.id_to_token(511) is not None  # the fillers reach the model's last id: every sampled id decodes
    line = "What shall we do with him, my lord?"
    assert bpe.decode(bpe.encode(line).ids) == line


def test_fixed_prompts_when_tiny_shakespeare_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_DATA", str(tmp_path / "none"))
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    script = load_script()
    prompts, source = script.read_prompts()
    assert prompts == list(script.PROMPTS) and "fixed prompts" in source
    assert all(set(p) <= LM_CHARS for p in prompts)  # a character model of tiny Shakespeare knows them


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--endpoint", "generate"], "needs --model PATH or --make-gpt2 DIR"),
        (["--endpoint", "generate", "--model", "m", "--clients", "1,x"], "--clients must be positive integers"),
        (["--endpoint", "generate", "--model", "m", "--workers", "0"], "--workers must be positive integers"),
        (["--endpoint", "generate", "--make-gpt2", "d", "--gpt2-width", "200"], "--gpt2-width 200 is not a multiple"),
        (["--endpoint", "generate", "--model", "m", "--max-tokens", "0"], "--max-tokens must be positive"),
    ],
)
def test_option_errors(tmp_path, monkeypatch, capsys, argv, message):
    script = load_script()
    monkeypatch.setattr(sys, "argv", ["serve_load.py", *argv, "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as stop:
        script.main()
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_make_gpt2_refuses_a_folder_with_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="exists and holds no config.json"):
        load_script().make_gpt2(tmp_path, 2, 64, 512)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_translate_mode_still_runs(tmp_path):
    data = tmp_path / "multi30k"
    data.mkdir()
    with gzip.open(data / "test_2016_flickr.en.gz", "wt", encoding="utf-8") as f:
        f.write("A man rides a bicycle.\nTwo dogs play in the snow.\nA woman reads a book.\n")
    out = tmp_path / "out.json"
    command = [sys.executable, str(SCRIPT), "--run", str(FIXTURES / "translation_run"), "--data", str(data)]
    command += ["--clients", "1,2", "--requests-per-client", "1", "--min-requests", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(p["batching"], p["clients"], p["ok"], p["failed"]) for p in report["phases"]] == [
        ("on", 1, 2, 0),
        ("on", 2, 2, 0),
        ("off", 1, 2, 0),
        ("off", 2, 2, 0),
    ]
    assert report["stalled"]["refused_or_failed_valid_requests"] == 0 and report["stalled"]["ok"] == 32
