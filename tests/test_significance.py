"""Paired significance of BLEU differences (qkv.metrics.significance.paired_significance, sacreBLEU's tests) and
benchmarks/significance.py, against direct sacreBLEU scores and properties any such test must have."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import sacrebleu
from bench_loader import load_benchmark

from qkv.metrics.scores import read_translations
from qkv.metrics.significance import paired_significance

WORDS = [
    "ein",
    "mann",
    "eine",
    "frau",
    "zwei",
    "hunde",
    "spielen",
    "im",
    "park",
    "auf",
    "der",
    "straße",
    "mit",
    "einem",
    "ball",
    "und",
    "lachen",
    "laut",
]


def references(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


def damaged(refs: list[str], share: float, seed: int) -> list[str]:
    """Each word of each reference replaced by a random one with probability ``share``."""
    rng = random.Random(seed)
    return [" ".join(w if rng.random() >= share else rng.choice(WORDS) for w in r.split()) for r in refs]


def test_read_translations_keeps_empty_lines_and_drops_the_final_newline(tmp_path):
    f = tmp_path / "val.hyp.de"
    f.write_text("a b\n\nc\n", encoding="utf-8")
    assert read_translations(f) == ["a b", "", "c"]
    f.write_text("a b\n\nc", encoding="utf-8")  # no newline after the last line
    assert read_translations(f) == ["a b", "", "c"]
    f.write_text("\n", encoding="utf-8")  # one empty translation
    assert read_translations(f) == [""]


def test_scores_are_sacrebleus_and_a_real_difference_is_found():
    refs = references(300)
    systems = {"poor": damaged(refs, 0.5, seed=1), "good": damaged(refs, 0.1, seed=2)}
    out = paired_significance(systems, refs, resamples=300, trials=300)
    for name, hyps in systems.items():
        assert out[name]["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert out["poor"]["p_bootstrap"] is None and out["poor"]["p_randomization"] is None  # the baseline
    assert out["good"]["bleu"] > out["poor"]["bleu"] + 20
    assert out["good"]["p_bootstrap"] < 0.01 and out["good"]["p_randomization"] < 0.01


def test_equally_good_systems_are_not_called_different():
    refs = references(300)
    # the same damage rate, different words damaged: any difference is the sample's
    out = paired_significance(
        {"a": damaged(refs, 0.3, seed=1), "b": damaged(refs, 0.3, seed=2)}, refs, resamples=300, trials=300
    )
    assert abs(out["b"]["bleu"] - out["a"]["bleu"]) < 3
    assert out["b"]["p_bootstrap"] > 0.05 and out["b"]["p_randomization"] > 0.05


def test_identical_translations_are_no_difference_and_differing_sentences_are_counted():
    """sacreBLEU's count is strict, so identical systems would get its smallest p; a copy of the baseline
    is reported as no difference at all. A system one sentence away keeps sacreBLEU's figures (its
    randomization p is small for a tiny difference: every swap reproduces it), with the count beside."""
    refs = references(200)
    base = damaged(refs, 0.3, seed=1)
    one_changed = [*base[:-1], refs[-1]]
    out = paired_significance({"base": base, "copy": list(base), "one": one_changed}, refs, resamples=200, trials=200)
    assert out["copy"]["bleu"] == out["base"]["bleu"] and out["base"]["differing"] is None
    assert out["copy"]["p_bootstrap"] == 1.0 and out["copy"]["p_randomization"] == 1.0
    assert out["copy"]["differing"] == 0 and out["one"]["differing"] == 1
    assert out["one"]["p_randomization"] == round(1 / 201, 4)


def test_the_interval_holds_the_score_and_narrows_with_four_times_the_sentences():
    refs = references(200)
    hyps = {"a": damaged(refs, 0.3, seed=1), "b": damaged(refs, 0.3, seed=2)}
    small = paired_significance(hyps, refs, resamples=400, trials=100)
    big = paired_significance({k: v * 4 for k, v in hyps.items()}, refs * 4, resamples=400, trials=100)
    for name in hyps:
        r = small[name]
        assert r["bootstrap_mean"] - r["ci95"] <= r["bleu"] <= r["bootstrap_mean"] + r["ci95"]
        assert big[name]["bleu"] == pytest.approx(r["bleu"], abs=0.01)  # BLEU of a repeated corpus: the same
        assert 0.35 < big[name]["ci95"] / r["ci95"] < 0.65  # ~1/sqrt(4)


def test_the_seed_makes_it_repeatable_and_sacrebleus_variable_is_put_back(monkeypatch):
    monkeypatch.setenv("SACREBLEU_SEED", "7")
    refs = references(100)
    systems = {"a": damaged(refs, 0.3, seed=1), "b": damaged(refs, 0.2, seed=2)}
    first = paired_significance(systems, refs, resamples=200, trials=200, seed=3)
    assert paired_significance(systems, refs, resamples=200, trials=200, seed=3) == first
    assert os.environ["SACREBLEU_SEED"] == "7"


def test_bad_inputs_are_refused_with_the_name():
    refs = references(10)
    with pytest.raises(ValueError, match="b: 9 translations for 10 references"):
        paired_significance({"a": refs, "b": refs[:9]}, refs)
    with pytest.raises(ValueError, match="baseline and at least one"):
        paired_significance({"a": refs}, refs)


def multi30k_folder(tmp_path: Path, val_de: list[str]) -> Path:
    """A Multi30k folder whose validation German is ``val_de`` (every other file: filler)."""
    data = tmp_path / "multi30k"
    data.mkdir()
    for stem in ("train", "val", "test_2016_flickr"):
        german = val_de if stem == "val" else ["x y"] * 3
        (data / f"{stem}.de").write_text("".join(r + "\n" for r in german), encoding="utf-8")
        (data / f"{stem}.en").write_text("x\n" * len(german), encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def significance():
    return load_benchmark("significance")


def test_the_script_compares_run_folders_and_files(tmp_path, significance, capsys):
    refs = references(120)
    data = multi30k_folder(tmp_path, refs)
    run = tmp_path / "run"
    run.mkdir()
    poor, good = damaged(refs, 0.5, seed=1), damaged(refs, 0.1, seed=2)
    (run / "val.hyp.de").write_text("".join(h + "\n" for h in poor), encoding="utf-8")
    good_file = tmp_path / "good.txt"
    good_file.write_text("".join(h + "\n" for h in good), encoding="utf-8")
    out = tmp_path / "sig.json"
    code = significance.main(
        [
            "--data",
            str(data),
            "--run",
            f"poor={run}",
            "--run",
            f"good={good_file}",
            "--resamples",
            "200",
            "--trials",
            "200",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads(out.read_text())
    assert report["sentences"] == 120
    assert report["results"]["poor"]["bleu"] == round(sacrebleu.corpus_bleu(poor, [refs]).score, 2)
    assert report["results"]["good"]["p_randomization"] < 0.01
    assert "good" in printed.out and "machine" in report


def test_the_script_refuses_a_missing_file_and_a_single_run(tmp_path, significance, capsys):
    data = multi30k_folder(tmp_path, ["a", "b"])
    out = tmp_path / "sig.json"
    code = significance.main(
        ["--data", str(data), "--run", f"a={tmp_path}", "--run", f"b={tmp_path}", "--out", str(out)]
    )
    assert code == 2 and "val.hyp.de: no such file" in capsys.readouterr().err and not out.exists()
    for argv, message in (
        (["--run", f"a={tmp_path}"], "at least one other --run"),
        (["--run", "nopath"], "NAME=PATH"),
        (["--run", f"a={tmp_path}", "--run", f"a={tmp_path}"], "its own NAME"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            significance.main(["--data", str(data), *argv, "--out", str(out)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
