"""``qkv demo``, the README's first command, end to end on a short budget: it trains, scores the
held-out dates, and writes the explorer, the heatmaps, the run folder and summary.json (a demo that
crashed after training went unnoticed for a session: nothing ran it)."""

import json
import subprocess
import sys

from qkv.data.sources import load_split
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import exact_match
from qkv.runs.folder import load_run


def test_qkv_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "demo", "--out", str(out), "--minutes", "0.15", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] > 0 and summary["test_dates"] == 2000 and 0 <= summary["exact_match"] <= 1
    assert f"exact match on 2,000 held-out dates: {100 * summary['exact_match']:.2f}%" in result.stdout
    # what stopped the training (a 0.15-minute budget or the target), and where to look next
    assert "stopped by the time budget (max_minutes 0.15" in result.stdout or "stopped early" in result.stdout
    assert result.stdout.rstrip().endswith(
        f"open {out / 'attention.html'} in a browser: the attention of every head, offline"
    )
    assert (out / "attention.html").stat().st_size > 0 and len(list((out / "heatmaps").glob("*.png"))) == 8
    # the reported exact match is the run's model's, recomputed here
    model, tokenizer, _ = load_run(out / "run")
    test = load_split({"source": "dates", "train_size": 20000, "valid_size": 500, "seed": 0}, "test")
    assert round(exact_match(translate_texts(model, tokenizer, test.src), test.tgt), 4) == summary["exact_match"]
