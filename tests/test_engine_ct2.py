"""``qkv translate`` / ``qkv evaluate`` with ``--engine ctranslate2``: CTranslate2 (the reference) decodes a
trained dates run exactly as qkv does, greedy and beam search with qkv's power-form length penalty; the
run folder is never written to; an export folder works as RUN_DIR; int8 runs; ``--threads`` reaches
CTranslate2; what CTranslate2 cannot do is refused in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("ctranslate2")

from qkv.cli import main  # noqa: E402  (after the skip: without ctranslate2 nothing here runs)
from qkv.data.dates import generate_dates  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
TINY = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
TINY += ["--max-tokens", "800", "--no-progress", "--threads", "1"]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def dates(tmp_path_factory):
    """A dates run trained 150 steps (varied, partly right translations), 400 test sources in a file,
    and the run's files as they were before any test decoded with it."""
    root = tmp_path_factory.mktemp("engine_ct2")
    run_dir = root / "run"
    args = ["train", "--data", "dates", "--run-dir", str(run_dir), "--max-steps", "150", "--minutes", "0"]
    assert main([*args, "--eval-every-steps", "0", *TINY]) == 0
    torch.set_num_threads(1)  # the CLI call set all cores (see conftest)
    sources = root / "dates.src"
    sources.write_text("".join(s + "\n" for s in generate_dates(400, seed=3, split="test").src))
    return run_dir, sources, snapshot(run_dir)


def translate(run_dir: Path, sources: Path, out: Path, *options: str) -> list[str]:
    assert main(["translate", str(run_dir), str(sources), "-o", str(out), "--threads", "1", *options]) == 0
    torch.set_num_threads(1)
    return out.read_text().splitlines()


def test_greedy_equals_qkv(dates, tmp_path):
    run_dir, sources, before = dates
    ours = translate(run_dir, sources, tmp_path / "qkv.txt", "--beam", "1")
    theirs = translate(run_dir, sources, tmp_path / "ct2.txt", "--beam", "1", "--engine", "ctranslate2")
    assert len(ours) == 400 and len(set(ours)) > 200  # varied outputs: a real comparison
    assert theirs == ours
    assert snapshot(run_dir) == before  # converted into a temporary folder, never into the run


def test_beam_power_form_equals_qkv(dates, tmp_path):
    """Beam 4, alpha 0.6: with the power form (len ** alpha, EOS counted) qkv's beam search ranks and stops as
    CTranslate2's does: every translation identical. The GNMT form gives other translations for some
    sentences, so the agreement is not that of a penalty that changes nothing."""
    run_dir, sources, before = dates
    beam = ["--beam", "4", "--alpha", "0.6"]
    power = translate(run_dir, sources, tmp_path / "power.txt", *beam, "--length-penalty-form", "power")
    gnmt = translate(run_dir, sources, tmp_path / "gnmt.txt", *beam)  # qkv's default form
    theirs = translate(run_dir, sources, tmp_path / "ct2.txt", *beam, "--engine", "ctranslate2")
    assert theirs == power
    assert gnmt != power
    assert snapshot(run_dir) == before


def evaluate(capsys, run_dir: Path, *options: str) -> dict:
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--json", "--threads", "1", *options]) == 0
    torch.set_num_threads(1)
    return json.loads(capsys.readouterr().out)


def test_evaluate_scores_as_qkv_power(dates, tmp_path, capsys):
    run_dir, _, before = dates
    options = ["--split", "test", "--limit", "300", "--beam", "4", "--alpha", "0.6"]
    ours = evaluate(capsys, run_dir, *options, "--length-penalty-form", "power", "--hyp-out", str(tmp_path / "q"))
    theirs = evaluate(capsys, run_dir, *options, "--engine", "ctranslate2", "--hyp-out", str(tmp_path / "c"))
    assert (tmp_path / "c").read_text() == (tmp_path / "q").read_text()
    assert 0 < theirs["bleu"] == ours["bleu"] and theirs["exact_match"] == ours["exact_match"]
    assert (theirs["engine"], theirs["length_penalty_form"], theirs["compute_type"]) == (
        "ctranslate2",
        "power",
        "float32",
    )
    assert (ours["engine"], ours["length_penalty_form"]) == ("qkv", "power")
    assert snapshot(run_dir) == before


def test_export_folder_and_int8(dates, tmp_path, capsys):
    """An export made by qkv export decodes as the run converted on the fly; int8 (stored, or as the compute
    type of a float32 folder) translates every line and scores."""
    run_dir, sources, _ = dates
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(tmp_path / "f32")]) == 0
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(tmp_path / "i8"), "--quantization", "int8"]) == 0
    engine = ["--engine", "ctranslate2", "--beam", "4"]
    from_run = translate(run_dir, sources, tmp_path / "run.txt", *engine)
    assert translate(tmp_path / "f32", sources, tmp_path / "f32.txt", *engine) == from_run
    stored = translate(tmp_path / "i8", sources, tmp_path / "i8.txt", *engine)
    loaded = translate(run_dir, sources, tmp_path / "q8.txt", *engine, "--quantization", "int8")
    assert len(stored) == len(loaded) == 400
    print(f"int8 beam 4: {sum(a == b for a, b in zip(from_run, loaded))}/400 identical to float32")
    refs = tmp_path / "dates.ref"
    refs.write_text("".join(t + "\n" for t in generate_dates(400, seed=3, split="test").tgt))
    scored = evaluate(capsys, tmp_path / "i8", "--src", str(sources), "--ref", str(refs), *engine)
    assert scored["sentences"] == 400 and scored["bleu"] > 0 and scored["compute_type"].startswith("int8")


def test_threads_reach_ctranslate2(dates, tmp_path, monkeypatch):
    import ctranslate2

    seen = []
    original = ctranslate2.Translator

    def recording(*args, **kwargs):
        seen.append((kwargs.get("intra_threads"), kwargs.get("compute_type")))
        return original(*args, **kwargs)

    monkeypatch.setattr(ctranslate2, "Translator", recording)
    run_dir, sources, _ = dates
    translate(run_dir, sources, tmp_path / "out.txt", "--engine", "ctranslate2", "--quantization", "int8")
    assert seen[-1] == (1, "int8")  # the export's own check loads one too, before


def test_refusals(dates, tmp_path, capsys):
    run_dir, sources, before = dates
    folder = tmp_path / "ct2"
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(folder)]) == 0
    other = shutil.copytree(run_dir, tmp_path / "other")
    ct2 = ["--engine", "ctranslate2"]
    cases = {
        "applies to --engine ctranslate2 only": ["translate", str(run_dir), str(sources), "--quantization", "int8"],
        "divides by len ** alpha only": [
            "translate",
            str(run_dir),
            str(sources),
            *ct2,
            "--length-penalty-form",
            "gnmt",
        ],
        "CTranslate2 decodes one model": ["translate", str(run_dir), str(sources), *ct2, "--ensemble", str(other)],
        "use --quantization bfloat16": ["evaluate", str(run_dir), *ct2, "--bf16"],
        "other runs are decoded by qkv": ["evaluate", str(run_dir), *ct2, "--against", str(other)],
        "holds one set of weights": ["translate", str(folder), str(sources), *ct2, "--weights", "best"],
        "keeps no data splits": ["evaluate", str(folder), *ct2],
        "language-model run": ["evaluate", str(FIXTURES / "lm_run"), *ct2],
        "evaluate: error: --quantization int8": ["evaluate", str(run_dir), "--quantization", "int8"],
    }
    for expected, argv in cases.items():
        capsys.readouterr()
        assert main(argv) == 2, expected
        error = capsys.readouterr().err.strip()
        assert expected in error and "\n" not in error, error
    assert snapshot(run_dir) == before
