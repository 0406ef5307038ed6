"""Crash-consistency trials: ``qkv train`` with a checkpoint every step, killed with SIGKILL at
random moments; after each kill the run must load in ``qkv translate``, and ``--resume`` must
finish it with final weights equal, bit for bit, to an uninterrupted run's.

Used by tests/test_crash_consistency.py (5 kills in the default suite, 100 in the slow one) and
benchmarks/crash_consistency.py (the README's figures). A *chain* is one run killed again and
again: every kill is followed by a check on a copy (translate loads it; resuming the copy to the
end gives the uninterrupted weights), then the chain goes on by resuming the killed folder itself
in a new process, which is killed in turn.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from qkv.cli import main
from qkv.data.dates import generate_dates

STEPS = 150
MODEL = [
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
    "--vocab-size",
    "300",
    "--max-len",
    "64",
]
TRAIN = [
    "--max-tokens",
    "400",
    "--checkpoint-every-steps",
    "1",
    "--average-last",
    "2",
    "--minutes",
    "0",
    "--no-bf16",
    "--no-progress",
    "--threads",
    "1",
    "--eval-every-steps",
    "0",
    "--log-every-steps",
    "1",
]


def write_data(folder: Path) -> tuple[Path, Path]:
    pairs = generate_dates(200, seed=11)
    folder.mkdir(parents=True, exist_ok=True)
    src, tgt = folder / "train.src", folder / "train.tgt"
    src.write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    return src, tgt


def start_args(src: Path, tgt: Path, run_dir: Path, steps: int = STEPS) -> list[str]:
    return [
        "train",
        "--train-src",
        str(src),
        "--train-tgt",
        str(tgt),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        *MODEL,
        *TRAIN,
    ]


def resume_args(run_dir: Path) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--resume", "--no-progress", "--threads", "1"]


def quiet_main(argv: list[str], stdin: bytes | None = None) -> int:
    """``qkv.cli.main`` in this process, its output swallowed (and stdin given)."""
    saved_stdin = sys.stdin
    try:
        if stdin is not None:
            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            torch.set_num_threads(1)
            return main(argv)
    finally:
        sys.stdin = saved_stdin


def terminate_after_steps(argv: list[str], run_dir: Path, logged: int) -> tuple[subprocess.Popen, str, int, int]:
    """Start ``argv`` (a training process), send it SIGTERM once ``metrics.jsonl`` holds ``logged``
    training records, and wait for it: ``(process, its stderr, the step state.pt saved, the last
    step logged)``."""
    import json

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline, seen = run_dir / "metrics.jsonl", time.monotonic() + 240, 0
    while seen < logged and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if metrics.is_file():
            seen = sum('"train"' in line for line in metrics.read_text().splitlines())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    state = run_dir / "state.pt"
    saved = torch.load(state, weights_only=True, map_location="cpu")["train_state"]["step"] if state.is_file() else -1
    trained = (
        max((json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line), default=-1)
        if metrics.is_file()
        else -1
    )
    return proc, err, saved, trained


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "state.pt", weights_only=True, map_location="cpu")["model"]


def uninterrupted(root: Path, src: Path, tgt: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    run_dir = root / "uninterrupted"
    assert quiet_main(start_args(src, tgt, run_dir, steps)) == 0
    return final_weights(run_dir)


@dataclass
class Kill:
    """What one SIGKILL left behind."""

    after_seconds: float
    moment: str  # before-run-folder | mid-write | between-files | between-saves | after-finish
    step: int | None
    translate_ok: bool
    resumed_equal: bool


@dataclass
class ChainReport:
    kills: list[Kill] = field(default_factory=list)
    chain_final_equal: bool = False


def classify(run_dir: Path) -> tuple[str, int | None]:
    """Where in the save sequence a kill landed, judged from the files it left."""
    if not run_dir.exists():
        return "before-run-folder", None
    state = torch.load(run_dir / "state.pt", weights_only=True, map_location="cpu")
    step = int(state["train_state"]["step"])
    if list(run_dir.rglob(".*.tmp")):
        return "mid-write", step
    with safe_open(str(run_dir / "last.safetensors"), framework="pt") as handle:
        last_step = int((handle.metadata() or {}).get("step", step))
    if last_step != step:
        return "between-files", step
    if (run_dir / "model.safetensors").exists():
        return "after-finish", step
    return "between-saves", step


def check_after_kill(run_dir: Path, scratch: Path, expected: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """(``qkv translate`` loads the killed run, resuming a copy of it to the end gives ``expected``)."""
    if not run_dir.exists():  # killed before the folder was renamed into place: nothing to load yet
        return True, True
    copy = scratch / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy)
    translate_ok = quiet_main(["translate", str(copy), "--beam", "1", "--threads", "1"], stdin=b"3 March 1998\n") == 0
    resumed_ok = quiet_main(resume_args(copy)) == 0
    weights = final_weights(copy)
    equal = (
        resumed_ok and weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    )
    shutil.rmtree(copy, ignore_errors=True)
    return translate_ok, equal


def run_chain(
    root: Path,
    src: Path,
    tgt: Path,
    expected: dict[str, torch.Tensor],
    kills: int,
    *,
    seed: int,
    steps: int = STEPS,
    window: float = 1.0,
    log=None,
) -> ChainReport:
    """Kill one run ``kills`` times at random moments, checking after each kill; then let it finish."""
    rng = random.Random(seed)
    run_dir = root / "chain"
    report = ChainReport()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    startup = None
    for _ in range(kills):
        argv = resume_args(run_dir) if run_dir.exists() else start_args(src, tgt, run_dir, steps)
        began = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "qkv", *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        if startup is None:  # the first process: how long until training starts (import, data, tokenizer)
            while process.poll() is None and not (run_dir / "state.pt").exists():
                time.sleep(0.005)
            startup = time.monotonic() - began
            deadline = time.monotonic() + rng.uniform(0, window)
        else:  # later ones resume: killed while loading, training or saving
            deadline = began + rng.uniform(0.8 * startup, startup + window)
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
        process.wait()
        err = process.stderr.read().decode("utf-8", "replace")
        assert "Traceback" not in err, err
        moment, step = classify(run_dir)
        translate_ok, resumed_equal = check_after_kill(run_dir, root, expected)
        kill = Kill(round(time.monotonic() - began, 3), moment, step, translate_ok, resumed_equal)
        report.kills.append(kill)
        if log:
            log(kill)
    if not run_dir.exists():
        assert quiet_main(start_args(src, tgt, run_dir, steps)) == 0
    else:
        assert quiet_main(resume_args(run_dir)) == 0
    weights = final_weights(run_dir)
    report.chain_final_equal = all(torch.equal(weights[k], expected[k]) for k in expected)
    return report
