"""qkv's language-model recipe against nanoGPT at equal minutes on the same machine (issue 55).

For each budget (``--minutes 5 10 30``), one after the other and with nothing else running:

1. nanoGPT, its own code from the checkout ``--nanogpt PATH`` (copied into ``--work-dir``; never
   part of this repository), with its README's CPU settings (``config/train_shakespeare_char.py
   --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
   --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0``) and ``max_iters = lr_decay_iters`` set so its
   schedule ends at the budget: the iterations that fit, from a short timing run first (the median
   iteration, and the extra seconds of its step-0 evaluation for each of its evaluations every 250
   iterations). Its data is its own ``data/shakespeare_char/prepare.py`` over the same tiny
   Shakespeare text (``$QKV_DATA``; copied in first, so nothing is downloaded). ``--seeds`` repeats
   each budget: nanoGPT's train.py seeds torch with 1337 plus its process's rank, a constant, so the
   copy gets a config value ``seed`` (1337, its own, for seed 0; 1337 + S for seed S), set with
   ``--seed=``; qkv gets ``--seed S``. The estimate can
   miss (the machine's speed drifts: one 30-minute schedule took 43 minutes), so the checkpoint
   nanoGPT holds when its loop passes the budget is copied aside (``ckpt_at_budget.pt``, taken
   between two iterations, never while it saves) and scored too: nanoGPT **at equal minutes**, beside
   nanoGPT **at its schedule's end**. ``--cut-at-budget`` stops it there (the second is then not
   measured).
2. qkv's default recipe: ``qkv train --data tinyshakespeare --minutes M`` (validation included in
   the minutes), in a subprocess like nanoGPT.
3. Both models scored the same way on the same text: nanoGPT's ``ckpt.pt`` (the weights it saved,
   at its best validation estimate) loaded into qkv's ``CausalLM`` (:mod:`qkv.pretrained.nanogpt`;
   its logits equal nanoGPT's, tests/test_nanogpt_loader.py) and qkv's ``model.safetensors`` (what
   ``qkv evaluate`` reads: the best validation's weights under the recipe), each reading the text
   through its own character vocabulary. Scored: EVERY character of qkv's whole validation split
   and of its test split (the last 10% of the text cut 5%/5%; both lie inside nanoGPT's validation
   region, the last 10%, which nanoGPT never trains on), in nats per character, as non-overlapping
   windows of the SAME context (nanoGPT's 64, the shorter of the two; every character predicted
   from at most 64 before it within its window) plus one last window for the characters the
   others leave out. qkv's model is also scored at its own context (128), as extra information.

Recorded per budget and model: steps, training tokens/s, parameters, wall seconds, the validation
curve each tool logs itself (nanoGPT's printed val-loss estimates, 20 batches of its last 10%,
against seconds since its start; qkv's metrics.jsonl validation records, its first 200 windows of
its validation split, against minutes), and the two scores. The JSON is rewritten after each budget.

    QKV_DATA=/work/shared/data python benchmarks/lm_vs_nanogpt.py --nanogpt /path/to/nanoGPT \\
        --minutes 5 --out benchmarks/results/language-model/lm_vs_nanogpt_5min_MACHINE.json

A comparison over several seeds can be spread over sessions: ``--nanogpt-from EARLIER.json`` takes
nanoGPT's runs for the same minutes and seeds from an earlier report of this benchmark, and nanoGPT
trains only for the others. It is refused unless the earlier run was on a machine of the same kind
(CPU model, family, model number, AVX flags, threads, torch version) that ran at the same speed:
nanoGPT's timing run here within 10% of that report's. Machines of one kind have run at half the
speed on another day (0.084 s a nanoGPT iteration against 0.041), where equal minutes are not equal
compute. The report names that file under ``nanogpt_from``.

``--combine A.json B.json ...`` writes one report of the runs of several (say seed 0 and 1 from one
session, seed 2 from the next), with the summary over all of them; refused unless the reports ran on
machines of one kind, scored the same splits, hold no (minutes, seed) twice, and qkv's recipe file
(``src/qkv/runs/recipes/tinyshakespeare.toml``) is the same at each one's commit. ``--leave-out REPORT
MINUTES SEED WHY`` drops one report's run (one that was not a side by side, say), and the combined
report records it with the reason.

Smoke test (a minute; results into /tmp): ``--minutes 0.2 --timing-iters 101 --eval-interval 1 --out /tmp/lmvn.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from qkv.bench.provenance import machine as recorded_machine
from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.text import read_text_splits, resolve_tinyshakespeare
from qkv.models.causal_lm import IGNORE, CausalLM
from qkv.pretrained.nanogpt import load_nanogpt
from qkv.runs.curves import read_metrics
from qkv.runs.folder import load_run

NANOGPT_README_CPU = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]
NANOGPT_TOKENS_PER_ITER = 12 * 64
NANOGPT_EVAL_INTERVAL = 250  # config/train_shakespeare_char.py
ITER_LINE = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
TRAINED_LINE = re.compile(r"trained (\d+) steps \(([\d.]+) min, ([\d.]+) target tokens/s\)")
STEP_LINE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
LOOP_START_LINES = ("using fused AdamW", "number of parameters")  # nanoGPT's last lines before its loop


def run_logged(
    cmd: list[str], cwd: Path, log: Path, watch: Callable[[float, str], bool] | None = None
) -> tuple[list[tuple[float, str]], float]:
    """Run ``cmd``; every output line with its seconds since the start (also into ``log``), and the
    wall seconds. ``watch(t, line)`` sees each line as it comes; when it returns True the process is
    stopped there (not a failure)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    lines: list[tuple[float, str]] = []
    stopped = False
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            t = time.perf_counter() - start
            lines.append((t, line.rstrip("\n")))
            out.write(f"{t:9.2f} {line}")
            if watch is not None and watch(t, line.rstrip("\n")) and not stopped:
                stopped = True
                proc.terminate()
        code = proc.wait()
    if code != 0 and not stopped:
        sys.exit(f"{' '.join(cmd)} failed with status {code}; its output is in {log}")
    return lines, time.perf_counter() - start


class CheckpointAtBudget:
    """Watches nanoGPT's output and copies its ``ckpt.pt`` (the weights of its best validation estimate
    so far) to ``ckpt_at_budget.pt`` at the first iteration line once its loop has run ``seconds``.
    An iteration line is printed after any save of that iteration, so the copy never meets a
    half-written file. ``cut``: stop nanoGPT there."""

    def __init__(self, out_dir: Path, seconds: float, cut: bool = False) -> None:
        self.out_dir, self.seconds, self.cut = out_dir, seconds, cut
        self.loop_start: float | None = None
        self.iter: int | None = None  # the iteration at which the budget passed
        self.loop_seconds: float | None = None
        self.copied = False

    @property
    def path(self) -> Path:
        return self.out_dir / "ckpt_at_budget.pt"

    def __call__(self, t: float, line: str) -> bool:
        if line.startswith(LOOP_START_LINES):
            self.loop_start = t
            return False
        if self.loop_start is None or self.iter is not None or t - self.loop_start < self.seconds:
            return False
        if m := ITER_LINE.match(line):
            self.iter, self.loop_seconds = int(m[1]), t - self.loop_start
            if (self.out_dir / "ckpt.pt").is_file():
                shutil.copyfile(self.out_dir / "ckpt.pt", self.path)
                self.copied = True
            return self.cut
        return False


NANOGPT_SEED_LINE = "torch.manual_seed(1337 + seed_offset)"
NANOGPT_CONFIG_LINE = "config_keys = ["


def seedable(train_py: str) -> str:
    """nanoGPT's train.py with its constant seed 1337 made a config value ``seed`` (default 1337)."""
    if train_py.count(NANOGPT_SEED_LINE) != 1 or train_py.count(NANOGPT_CONFIG_LINE) != 1:
        sys.exit("nanoGPT's train.py: its seed line or its config_keys line is not where this benchmark expects")
    train_py = train_py.replace(NANOGPT_SEED_LINE, "torch.manual_seed(seed + seed_offset)")
    return train_py.replace(
        NANOGPT_CONFIG_LINE, "seed = 1337  # added by qkv's benchmark: --seed=N\n" + NANOGPT_CONFIG_LINE
    )


def prepare_nanogpt(source: Path, work: Path, text_path: Path) -> Path:
    """A copy of the nanoGPT checkout in ``work`` with tiny Shakespeare prepared by its own script,
    its seed a config value (:func:`seedable`)."""
    if not (source / "train.py").is_file() or not (source / "model.py").is_file():
        sys.exit(f"--nanogpt {source}: not a nanoGPT checkout (no train.py / model.py)")
    copy = work / "nanoGPT"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "out*", "*.bin", "*.pkl", "input.txt"))
    train_py = copy / "train.py"
    train_py.write_text(seedable(train_py.read_text(encoding="utf-8")), encoding="utf-8")
    data = copy / "data" / "shakespeare_char"
    shutil.copyfile(text_path, data / "input.txt")  # prepare.py downloads only when this is missing
    run_logged([sys.executable, "data/shakespeare_char/prepare.py"], copy, work / "nanogpt_prepare.log")
    return copy


def nanogpt_cmd(iters: int, out_dir: Path, eval_interval: int = NANOGPT_EVAL_INTERVAL, seed: int = 0) -> list[str]:
    """nanoGPT's command; ``eval_interval`` other than its config's 250 only for smoke tests."""
    extra = [] if eval_interval == NANOGPT_EVAL_INTERVAL else [f"--eval_interval={eval_interval}"]
    extra += [f"--seed={1337 + seed}"] if seed else []
    return [sys.executable, "train.py", *NANOGPT_README_CPU, *extra, f"--max_iters={iters}",
            f"--lr_decay_iters={iters}", f"--out_dir={out_dir}"]  # fmt: skip


def time_nanogpt(copy: Path, work: Path, iters: int) -> dict:
    """Seconds per iteration (median after the first 5) and the extra seconds of one evaluation
    (iteration 0's time holds the step-0 evaluation) from a run of ``iters`` iterations."""
    lines, wall = run_logged(nanogpt_cmd(iters, work / "out-timing"), copy, work / "nanogpt_timing.log")
    times = {int(m[1]): float(m[3]) / 1000 for _, line in lines if (m := ITER_LINE.match(line))}
    per_iter = statistics.median([t for i, t in times.items() if i >= 5] or [t for i, t in times.items() if i > 0])
    return {"iters": iters, "seconds_per_iter": per_iter, "eval_seconds": max(times[0] - per_iter, 0.0), "wall": wall}


def iters_for(seconds: float, timing: dict, eval_interval: int) -> int:
    """Iterations whose time plus one evaluation every ``eval_interval`` of them (and at 0) fits ``seconds``."""
    per, ev = timing["seconds_per_iter"], timing["eval_seconds"]
    return max(1, int((seconds - ev) / (per + ev / eval_interval)))


def train_nanogpt(
    copy: Path, work: Path, minutes: float, timing: dict, eval_interval: int, cut_at_budget: bool = False, seed: int = 0
) -> dict:
    iters = iters_for(minutes * 60, timing, eval_interval)
    name = f"nanogpt-{minutes:g}min" + (f"-seed{seed}" if seed else "")
    out_dir = work / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    cmd = nanogpt_cmd(iters, out_dir, eval_interval, seed)
    at_budget = CheckpointAtBudget(out_dir, minutes * 60, cut=cut_at_budget)
    lines, wall = run_logged(cmd, copy, work / f"{name}.log", watch=at_budget)
    starts = [t for t, line in lines if line.startswith(LOOP_START_LINES)]
    loop_start = starts[-1] if starts else 0.0
    iter_times = [(t, int(m[1]), float(m[3])) for t, line in lines if (m := ITER_LINE.match(line))]
    loop_seconds = iter_times[-1][0] - loop_start
    steps = iter_times[-1][1] + 1
    curve = [
        {"seconds": round(t, 1), "iter": int(m[1]), "train_loss": float(m[2]), "val_loss": float(m[3])}
        for t, line in lines
        if (m := STEP_LINE.match(line))
    ]
    settled = (
        [ms for _, i, ms in iter_times if i >= 5] or [ms for _, i, ms in iter_times if i > 0] or [iter_times[-1][2]]
    )
    median_ms = statistics.median(settled)
    if not (out_dir / "ckpt.pt").is_file():
        sys.exit(f"nanoGPT saved no checkpoint in {out_dir} ({iters} iterations, fewer than one evaluation interval)")
    if at_budget.iter is None:  # its schedule ended within the budget: the end is its state at the budget
        budget = {"iter": steps - 1, "loop_seconds": round(loop_seconds, 1), "checkpoint": str(out_dir / "ckpt.pt")}
    else:
        assert at_budget.loop_seconds is not None
        budget = {
            "iter": at_budget.iter,
            "loop_seconds": round(at_budget.loop_seconds, 1),
            "checkpoint": str(at_budget.path) if at_budget.copied else None,  # None: nothing saved yet
        }
    return {
        "command": " ".join(cmd[1:]),
        "max_iters": iters,
        "cut_at_budget": cut_at_budget and at_budget.iter is not None,
        "at_budget": budget,
        "steps": steps,
        "tokens_per_step": NANOGPT_TOKENS_PER_ITER,
        "training_loop_seconds": round(loop_seconds, 1),
        "loop_started_at_seconds": round(loop_start, 1),
        "process_wall_seconds": round(wall, 1),
        "tokens_per_s_median_iteration": round(NANOGPT_TOKENS_PER_ITER / (median_ms / 1000), 1),
        "tokens_per_s_overall": round(steps * NANOGPT_TOKENS_PER_ITER / loop_seconds, 1),
        "val_curve": curve,
        "out_dir": str(out_dir),
    }


def train_qkv(work: Path, minutes: float, seed: int = 0) -> dict:
    name = f"qkv-{minutes:g}min" + (f"-seed{seed}" if seed else "")
    run_dir = work / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "qkv", "train", "--data", "tinyshakespeare", "--minutes", f"{minutes:g}",
           "--run-dir", str(run_dir)] + (["--seed", str(seed)] if seed else [])  # fmt: skip
    lines, wall = run_logged(cmd, Path.cwd(), work / f"{name}.log")
    done = [m for _, line in lines if (m := TRAINED_LINE.search(line))]  # qkv train's last line
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    last = max(records, key=lambda r: r.get("step", 0)) if records else {}
    config = read_config(run_dir)
    max_tokens = int(config["train"]["max_tokens"])
    steps, run_minutes = int(last.get("step", 0)), float(last.get("minutes", 0.0))
    if done:  # the final step count; the minutes of the last record are finer than the line's one decimal
        steps, run_minutes = int(done[-1][1]), run_minutes or float(done[-1][2])
    return {
        "command": "qkv " + " ".join(cmd[3:]),
        "steps": steps,
        "tokens_per_step": max_tokens,
        "run_minutes_at_last_record": run_minutes,
        "tokens_per_s_reported": float(done[-1][3]) if done else None,
        "process_wall_seconds": round(wall, 1),
        "tokens_per_s_median_log_window": statistics.median(r["tokens_per_s"] for r in train) if train else None,
        "tokens_per_s_overall": round(steps * max_tokens / (run_minutes * 60), 1) if run_minutes else None,
        "val_curve": [
            {"seconds": round(r["minutes"] * 60, 1), "step": r["step"], "val_loss": r["val_loss"]} for r in valid
        ],
        "run_dir": str(run_dir),
        "model": {k: config["model"][k] for k in ("d_model", "num_layers", "num_heads", "d_ff", "context", "dropout")},
        "schedule": {k: config["train"][k] for k in ("schedule", "decay_fraction", "lr_factor", "warmup_steps")},
        "sizing": config.get("recipe", {}).get("sizing"),  # the size the budget chose, and why
    }


def read_config(run_dir: Path) -> dict:
    from qkv.runtime.fileio import read_json

    return read_json(run_dir / "config.json")


@torch.no_grad()
def score(model: CausalLM, ids: list[int], context: int, batch: int = 32) -> dict:
    """Mean next-character loss (nats) over EVERY character of ``ids`` after the first: windows of
    ``context`` end to end, then one window ending at the last character scoring only what the
    others left out."""
    model.eval()
    tokens = np.asarray(ids, dtype=np.int64)
    n = len(tokens)
    full = (n - 1) // context
    total, count = 0.0, 0
    for i in range(0, full, batch):
        rows = np.stack([tokens[s * context : s * context + context + 1] for s in range(i, min(i + batch, full))])
        block = torch.from_numpy(rows)
        total += float(model.loss(block[:, :-1], block[:, 1:]))
        count += block[:, 1:].numel()
    covered = full * context
    if covered < n - 1:
        start = n - 1 - context
        block = torch.from_numpy(tokens[start:][None].copy())
        targets = block[:, 1:].clone()
        targets[:, : covered - start] = IGNORE
        total += float(model.loss(block[:, :-1], targets))
        count += int((targets != IGNORE).sum())
    if count != n - 1:
        raise AssertionError(f"scored {count} of {n - 1} characters")
    return {"nats_per_char": round(total / count, 4), "chars_scored": count, "context": context}


def score_both(nanogpt: dict, qkv: dict, splits: dict[str, str], chars: list[str]) -> None:
    """Add ``scores`` (validation and test splits, the same windows) and ``parameters`` to both records."""
    nano_model, info = load_nanogpt(Path(nanogpt["out_dir"]) / "ckpt.pt")
    if nano_model.config.vocab_size != len(chars):
        sys.exit(f"nanoGPT's vocabulary has {nano_model.config.vocab_size} characters, the text {len(chars)}")
    stoi = {c: i for i, c in enumerate(chars)}  # nanoGPT's prepare.py: sorted(set(text))
    qkv_model = score_qkv(qkv, splits, nano_model.config.context)
    context = min(nano_model.config.context, qkv_model.config.context)
    nanogpt.update(parameters=info["parameters"], checkpoint_iter=info["iter_num"], scores={})
    budget = nanogpt["at_budget"]
    budget_model = None
    if budget["checkpoint"] is not None and Path(budget["checkpoint"]) != Path(nanogpt["out_dir"]) / "ckpt.pt":
        budget_model, budget_info = load_nanogpt(Path(budget["checkpoint"]))
        budget.update(checkpoint_iter=budget_info["iter_num"], scores={})
    elif budget["checkpoint"] is not None:  # the same weights as at its schedule's end
        budget.update(checkpoint_iter=info["iter_num"], scores=nanogpt["scores"])
    for name, text in splits.items():
        nano_ids = [stoi[c] for c in text]
        nanogpt["scores"][name] = score(nano_model, nano_ids, context)
        if budget_model is not None:
            budget["scores"][name] = score(budget_model, nano_ids, context)


def score_qkv(qkv: dict, splits: dict[str, str], other_context: int) -> CausalLM:
    """Add ``scores`` (at the shorter of the two contexts), ``scores_own_context`` and ``parameters``
    to qkv's record; its model."""
    qkv_model, tokenizer, _ = load_run(qkv["run_dir"], "model", task="lm")
    assert isinstance(qkv_model, CausalLM)
    context = min(other_context, qkv_model.config.context)
    qkv["parameters"] = sum(p.numel() for p in qkv_model.parameters())
    qkv["scores"], qkv["scores_own_context"] = {}, {}
    for name, text in splits.items():
        qkv_ids = tokenizer.encode(text)
        if len(qkv_ids) != len(text):
            sys.exit("qkv's run is not character-level; this benchmark compares character models")
        qkv["scores"][name] = score(qkv_model, qkv_ids, context)
        qkv["scores_own_context"][name] = score(qkv_model, qkv_ids, qkv_model.config.context)
    return qkv_model


MACHINE_KEYS = ("cpu_model", "cpu_family", "cpu_model_number", "avx2", "avx512_bf16", "amx", "threads", "torch")


def this_machine() -> dict:
    """This machine as the report records it (its speed flags included, as ``write_result`` adds them),
    so that an earlier report's machine compares key for key."""
    return {**recorded_machine(), **environment(), "threads": torch.get_num_threads()}


def earlier_nanogpt(path: Path, machine: dict, text: dict, splits: list[str]) -> tuple[dict, dict]:
    """``--nanogpt-from``: the nanoGPT runs of an earlier report of this benchmark, by (minutes, seed),
    and where they come from. Refused unless that report ran on a machine of this kind (the keys of
    ``MACHINE_KEYS``), on the same text, and scored every split asked for."""
    from qkv.runtime.fileio import read_json

    earlier = read_json(path)
    differ = [k for k in MACHINE_KEYS if earlier.get("machine", {}).get(k) != machine.get(k)]
    if differ:
        sys.exit(f"--nanogpt-from {path}: ran on another kind of machine ({', '.join(differ)} differ); "
                 "nanoGPT must run on this one")  # fmt: skip
    if earlier.get("text", {}).get("splits_chars") != text["splits_chars"]:
        sys.exit(f"--nanogpt-from {path}: its text's splits are not this text's")
    runs = {}
    for b in earlier.get("budgets", []):
        if all(name in b["nanogpt"]["at_budget"].get("scores", {}) for name in splits):
            runs[(b["minutes"], b["seed"])] = b["nanogpt"]
    source = {"path": str(path), "commit": earlier.get("commit"), "date": earlier.get("date"),
              "machine_time": earlier.get("machine", {}).get("time"),
              "nanogpt_timing_run": earlier.get("nanogpt_timing_run")}  # fmt: skip
    return runs, source


SPEED_TOLERANCE = 0.10


def same_speed(source: dict, timing: dict) -> None:
    """Exit unless this machine's nanoGPT timing run is within ``SPEED_TOLERANCE`` of the earlier
    report's: machines of one kind (same CPU, flags, threads) have run nanoGPT at half the speed on
    another day (0.084 s an iteration against 0.041), and minutes are then not the same compute."""
    then = (source.get("nanogpt_timing_run") or {}).get("seconds_per_iter")
    now = timing["seconds_per_iter"]
    if not then or abs(now / then - 1) > SPEED_TOLERANCE:
        sys.exit(f"--nanogpt-from {source['path']}: nanoGPT's iteration takes {now * 1000:.1f} ms here, "
                 f"{then * 1000 if then else float('nan'):.1f} ms in that report's run: not the same "
                 f"speed (within {SPEED_TOLERANCE:.0%}), so equal minutes would not be equal compute")  # fmt: skip


RECIPE_FILE = "src/qkv/runs/recipes/tinyshakespeare.toml"


def recipe_at(commit: str) -> str:
    """qkv's recipe file at ``commit`` of this repository (exits where the commit is not one of its)."""
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit or ""):
        sys.exit(f"--combine: commit {commit!r} is not a clean commit, so its recipe is not known")
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{RECIPE_FILE}"], capture_output=True, text=True)
    if shown.returncode != 0:
        sys.exit(f"--combine: commit {commit} is not in this repository ({shown.stderr.strip()})")
    return shown.stdout


def combine(
    paths: list[Path], recipe_of: Callable[[str], str] = recipe_at, leave_out: list[tuple[Path, float, int, str]] = ()
) -> dict:
    """One report of the runs of several reports of this benchmark, summarized over all of them.
    ``recipe_of``: the recipe file's text at a commit (tests give their own). ``leave_out``: (report,
    minutes, seed, why) for runs of a report that are not taken (say one that was not a side by side);
    each must be in that report, and is recorded with its reason."""
    from qkv.runtime.fileio import read_json

    reports = [read_json(path) for path in paths]
    dropped: dict[int, list] = {}
    for path, minutes, seed, why in leave_out:
        where = [i for i, known in enumerate(paths) if Path(known).resolve() == Path(path).resolve()]
        if not where:
            sys.exit(f"--leave-out: {path} is not one of the reports given to --combine")
        if not any((b["minutes"], b["seed"]) == (minutes, seed) for b in reports[where[0]].get("budgets", [])):
            sys.exit(f"--leave-out: {path} holds no run of {minutes:g} minutes with seed {seed}")
        if not why.strip():
            sys.exit("--leave-out: say why the run is left out")
        dropped.setdefault(where[0], []).append({"minutes": minutes, "seed": seed, "why": why})
    first = reports[0]
    for path, report in zip(paths[1:], reports[1:], strict=True):
        differ = [k for k in MACHINE_KEYS if report.get("machine", {}).get(k) != first.get("machine", {}).get(k)]
        if differ:
            sys.exit(f"--combine: {path} ran on another kind of machine than {paths[0]} ({', '.join(differ)} differ)")
        if report.get("text", {}).get("splits_chars") != first.get("text", {}).get("splits_chars"):
            sys.exit(f"--combine: {path}'s text splits are not {paths[0]}'s")
        if recipe_of(report.get("commit", "")) != recipe_of(first.get("commit", "")):
            sys.exit(f"--combine: qkv's recipe at {path}'s commit is not the one at {paths[0]}'s")
    kept = [[b for b in report.get("budgets", [])
             if (b["minutes"], b["seed"]) not in {(d["minutes"], d["seed"]) for d in dropped.get(i, [])}]
            for i, report in enumerate(reports)]  # fmt: skip
    budgets, seen = [], set()
    for path, runs in zip(paths, kept, strict=True):
        for b in runs:
            if (b["minutes"], b["seed"]) in seen:
                sys.exit(f"--combine: {path} holds ({b['minutes']:g} minutes, seed {b['seed']}) again")
            seen.add((b["minutes"], b["seed"]))
            budgets.append(b)
    splits = sorted({name for b in budgets for name in b["qkv"].get("scores", {})} & {"val", "test"})
    budgets.sort(key=lambda b: (b["minutes"], b["seed"]))
    sources = [{"path": str(path), "commit": r.get("commit"), "date": r.get("date"),
                "runs": [[b["minutes"], b["seed"]] for b in kept[i]],
                **({"left_out": dropped[i]} if i in dropped else {}),
                "nanogpt_timing_run": r.get("nanogpt_timing_run"), "nanogpt_from": r.get("nanogpt_from")}
               for i, (path, r) in enumerate(zip(paths, reports, strict=True))]  # fmt: skip
    return {
        **{k: first[k] for k in ("what", "text", "scoring") if k in first},
        "machine": first.get("machine"),
        "combined_from": sources,
        "budgets": budgets,
        "summary": summarize(budgets, splits),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (read, never written)")
    parser.add_argument("--minutes", type=float, nargs="+", default=[5.0], help="the budgets (default 5)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lm_vs_nanogpt"), help="runs and logs")
    parser.add_argument(
        "--timing-iters", type=int, default=120, help="nanoGPT's timing run (iterations; more than its 100 warmup ones)"
    )
    parser.add_argument(
        "--eval-interval", type=int, default=NANOGPT_EVAL_INTERVAL, help="nanoGPT's (250; smaller for smoke tests)"
    )
    parser.add_argument(
        "--cut-at-budget",
        action="store_true",
        help="stop nanoGPT when its loop passes the budget (default: let its schedule end, and score both)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each budget once per seed (default 0)")
    parser.add_argument(
        "--no-test",
        action="store_true",
        help="score the validation split only (for runs that choose; a finished recipe's test is scored once)",
    )
    parser.add_argument(
        "--nanogpt-from",
        type=Path,
        default=None,
        help="an earlier report of this benchmark on a machine of this kind and speed (nanoGPT's timing run "
        "within 10%%): its nanoGPT runs (same minutes and seeds) are taken from it and nanoGPT trains for "
        "the others only",
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="write one report of these reports' runs, the summary over all of them (nothing trains)",
    )
    parser.add_argument(
        "--leave-out",
        nargs=4,
        action="append",
        default=[],
        metavar=("REPORT", "MINUTES", "SEED", "WHY"),
        help="with --combine: do not take this report's run of these minutes and seed, for the reason given "
        "(recorded); repeatable",
    )
    add_result_options(parser, required=True)
    args = parser.parse_args(argv)
    if args.leave_out and not args.combine:
        parser.error("--leave-out goes with --combine")
    try:
        leave_out = [(Path(p), float(m), int(s), why) for p, m, s, why in args.leave_out]
    except ValueError:
        parser.error("--leave-out REPORT MINUTES SEED WHY: MINUTES is a number, SEED an integer")
    out = check_result_file(parser, args)
    if args.combine:
        write_result(out, combine(args.combine, leave_out=leave_out), argv)
        print(f"wrote {out}")
        return
    if args.nanogpt is None:
        parser.error(
            "give --nanogpt (a nanoGPT checkout; with --nanogpt-from its timing run checks this machine's speed)"
        )
    if any(not (m > 0 and math.isfinite(m)) for m in args.minutes):
        parser.error("--minutes must be positive")
    if args.timing_iters <= 100:  # nanoGPT's schedule divides by lr_decay_iters - warmup_iters (100)
        parser.error("--timing-iters must be more than nanoGPT's 100 warmup iterations")
    text_path = resolve_tinyshakespeare(download=False)
    texts = read_text_splits({"source": "tinyshakespeare", "folder": None})
    assert texts.test is not None
    whole = text_path.read_text(encoding="utf-8")
    chars = sorted(set(whole))
    nano_val_start = int(len(whole) * 0.9)  # nanoGPT's prepare.py: the last 10% validates
    inside = all(texts.chars[name][0] >= nano_val_start for name in ("val", "test"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    splits = {"val": texts.val} if args.no_test else {"val": texts.val, "test": texts.test}
    machine = this_machine()
    text = {"splits_chars": {k: list(v) for k, v in texts.chars.items() if v}}
    earlier, earlier_source = (
        earlier_nanogpt(args.nanogpt_from, machine, text, list(splits)) if args.nanogpt_from else ({}, None)
    )
    if earlier_source:
        earlier_source["taken"] = [[m, s] for m in args.minutes for s in args.seeds if (m, s) in earlier]
    copy = prepare_nanogpt(args.nanogpt.resolve(), args.work_dir, text_path)
    timing = time_nanogpt(copy, args.work_dir, args.timing_iters)
    if earlier_source:
        same_speed(earlier_source, timing)
    report: dict = {
        "what": "qkv's default language-model recipe vs nanoGPT (its own code, README CPU settings) at equal "
        "minutes, trained one after the other; both scored on qkv's whole validation and test splits",
        "machine": machine,
        "text": {
            "path": str(text_path),
            "chars": len(whole),
            "vocabulary": len(chars),
            "splits_chars": {k: list(v) for k, v in texts.chars.items() if v},
            "nanogpt_val_starts_at": nano_val_start,
            "scored_splits_inside_nanogpt_val": inside,
        },  # fmt: skip
        "scoring": "nats/char over every character of each split, non-overlapping windows of the shorter "
        "context (64) plus one last window; nanoGPT's ckpt.pt loaded into qkv's CausalLM",
        "nanogpt_timing_run": timing,
        "nanogpt_from": earlier_source,  # its runs ("taken"); the others trained here, each just before qkv
        "budgets": [],
    }
    for minutes in args.minutes:
        for seed in args.seeds:
            if (minutes, seed) in earlier:
                nanogpt = earlier[(minutes, seed)]
                qkv = train_qkv(args.work_dir, minutes, seed=seed)
                score_qkv(qkv, splits, nanogpt["scores"]["val"]["context"])
            else:
                nanogpt = train_nanogpt(
                    copy, args.work_dir, minutes, timing, args.eval_interval, args.cut_at_budget, seed=seed
                )
                qkv = train_qkv(args.work_dir, minutes, seed=seed)
                score_both(nanogpt, qkv, splits, chars)
            report["budgets"].append({"minutes": minutes, "seed": seed, "nanogpt": nanogpt, "qkv": qkv})
            report["summary"] = summarize(report["budgets"], list(splits))
            write_result(out, report, argv)
            for name in splits:
                at = nanogpt["at_budget"].get("scores", {}).get(name)
                print(f"{minutes:g} min, seed {seed}, {name}: nanoGPT {nanogpt['scores'][name]['nats_per_char']:.4f} "
                      f"at its schedule's end, {at['nats_per_char'] if at else float('nan'):.4f} at the budget; "
                      f"qkv {qkv['scores'][name]['nats_per_char']:.4f} nats/char")  # fmt: skip
    print(f"wrote {out}")


def summarize(budgets: list[dict], splits: list[str]) -> dict:
    """Per budget and split: the mean and spread (population) over the seeds of nanoGPT at equal
    minutes and of qkv, and ``qkv_ahead`` = nanoGPT's mean minus qkv's (positive: qkv is ahead)."""
    summary: dict = {}
    for minutes in sorted({b["minutes"] for b in budgets}):
        runs = [b for b in budgets if b["minutes"] == minutes]
        entry: dict = {"seeds": [b["seed"] for b in runs]}
        for name in splits:
            nano = [b["nanogpt"]["at_budget"]["scores"][name]["nats_per_char"] for b in runs
                    if b["nanogpt"]["at_budget"].get("scores")]  # fmt: skip
            ours = [b["qkv"]["scores"][name]["nats_per_char"] for b in runs]
            if not nano:
                continue
            entry[name] = {
                "nanogpt_mean": round(statistics.mean(nano), 4),
                "nanogpt_spread": round(statistics.pstdev(nano), 4),
                "qkv_mean": round(statistics.mean(ours), 4),
                "qkv_spread": round(statistics.pstdev(ours), 4),
                "qkv_ahead": round(statistics.mean(nano) - statistics.mean(ours), 4),
            }
        summary[f"{minutes:g}"] = entry
    return summary


if __name__ == "__main__":
    main()
