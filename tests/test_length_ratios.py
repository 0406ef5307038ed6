"""benchmarks/length_ratios.py: reference and translation lengths per split, against hand counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ratios_against_hand_counts(tmp_path):
    data = tmp_path / "multi30k"
    data.mkdir()
    texts = {  # (English, German) per split: words en / de
        "train": (["a b c d", "e f"], ["a b c", "d e"]),  # 6 / 5
        "val": (["a b", "c d e f"], ["a b c", "d e f g"]),  # 6 / 7
        "test_2016_flickr": (["a b c d e"], ["a b"]),  # 5 / 2
    }
    for stem, (en, de) in texts.items():
        (data / f"{stem}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
        (data / f"{stem}.de").write_text("\n".join(de) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    (run / "val.hyp.de").write_text("x y\nz\n", encoding="utf-8")  # 3 words
    (run / "test_2016.hyp.de").write_text("x y z w\n", encoding="utf-8")  # 4 words
    out = tmp_path / "ratios.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "length_ratios.py"),
            "--data-dir",
            str(data),
            "--run-dir",
            str(run),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    splits = json.loads(out.read_text())["splits"]
    assert splits["train"]["target_per_source_word"] == round(5 / 6, 4)
    assert splits["val"]["target_per_source_word"] == round(7 / 6, 4)
    assert splits["val"]["ratio_against_train"] == round(round(7 / 6, 4) / round(5 / 6, 4), 4)
    assert splits["val"]["translation_per_reference_word"] == round(3 / 7, 4)
    assert splits["test_2016"]["translation_per_source_word"] == round(4 / 5, 4)
    assert splits["test_2016"]["de_words_per_sentence"] == 2.0
    assert "translation_per_reference_word" not in splits["train"]


def run_on_two_line_splits(tmp_path, hyps: dict) -> subprocess.CompletedProcess:
    """The script on a data folder whose every split has two pairs, with a run folder holding ``hyps``."""
    data = tmp_path / "multi30k"
    data.mkdir()
    for stem in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            (data / f"{stem}.{lang}").write_text("a b\nc\n", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    for name, text in hyps.items():
        (run / name).write_text(text, encoding="utf-8")
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "length_ratios.py"),
            "--data-dir",
            str(data),
            "--run-dir",
            str(run),
            "--out",
            str(tmp_path / "o.json"),
        ],
        check=False,
        capture_output=True,
        text=True,
    )


def test_a_translation_file_of_the_wrong_length_is_refused(tmp_path):
    done = run_on_two_line_splits(tmp_path, {"val.hyp.de": "only one line\n"})
    assert done.returncode != 0 and "1 lines for 2 references" in done.stderr
    assert not (tmp_path / "o.json").exists()


def test_a_run_without_its_saved_translations_is_refused(tmp_path):
    done = run_on_two_line_splits(tmp_path, {"val.hyp.de": "x\ny\n"})  # no test_2016.hyp.de
    assert done.returncode != 0 and "test_2016.hyp.de: no such file" in done.stderr
    assert not (tmp_path / "o.json").exists()
