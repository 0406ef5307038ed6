"""What a newcomer tripped on: the set-up line, what stopped a run, a busy machine's hint and the
measured peak behind MFU, the recipes' own text, the README's loss example and a benchmark timer
that outlived its clock."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.bench.deadline import Clock, TimeUp
from qkv.data.text import CharTokenizer
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runtime import peaks
from qkv.training import LanguageModelTask, TrainConfig, Trainer
from qkv.training import throughput as throughput_module

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


# ----------------------------------------------------------------------------- the set-up line
def first_bash_block(path: Path) -> str:
    match = re.search(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert match, f"{path}: no bash block"
    return match.group(1)


def test_every_setup_line_takes_torch_from_the_cpu_index_and_they_agree():
    readme = first_bash_block(ROOT / "README.md")
    assert CPU_INDEX in readme and "pip install torch==2.13.0; }" in readme  # the CPU index, then the plain pin
    for doc in ("docs/getting-started.md", "docs/index.md"):
        assert first_bash_block(ROOT / doc) == readme, f"{doc} sets up otherwise than the README"
    for script in (".ci/run", ".ci/wheel_smoke.sh"):
        text = (ROOT / script).read_text(encoding="utf-8")
        assert f"{CPU_INDEX} torch==2.13.0" in text and "|| " in text, script
    for path in ("README.md", "docs/getting-started.md", "pyproject.toml", ".ci/run"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert "so that pip does not pull a multi-gigabyte CUDA build" not in text, path  # pinning alone does not


# ----------------------------------------------------------------------------- a tiny run
def tiny_trainer(tmp_path: Path, **train) -> Trainer:
    text = "".join(f"line {i}: to be, or not to be.\n" for i in range(200))
    tokenizer = CharTokenizer(sorted(set(text)))
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    task = LanguageModelTask(tokenizer, ids[:4000], None, context=32)
    config = CausalLMConfig(vocab_size=tokenizer.vocab_size, d_model=32, num_heads=4, num_layers=1, d_ff=64, context=32)
    options = dict(max_tokens=256, progress=False, average_last=1, log_every_steps=1, **train)
    return Trainer(CausalLM(config), task, TrainConfig(**options), tmp_path)


@pytest.fixture
def quiet_machine(monkeypatch):
    """An idle 2-core machine, whatever really runs beside the tests."""
    monkeypatch.setattr(throughput_module, "machine_load", lambda: (0.1, 2))


def test_the_final_line_names_max_steps(tmp_path, quiet_machine):
    trainer = tiny_trainer(tmp_path, max_steps=3)
    trainer.train()
    assert trainer.state.step == 3
    assert trainer.stopped_by() == "stopped by max_steps (max_steps 3, --max-steps)"


def test_the_final_line_names_the_time_budget_before_max_steps(tmp_path, quiet_machine):
    trainer = tiny_trainer(tmp_path, max_steps=100_000, max_minutes=1e-4)  # 6 ms: a step or two
    trainer.train()
    assert trainer.state.step < 100_000
    assert trainer.stopped_by() == "stopped by the time budget (max_minutes 0.0001, --minutes) before max_steps 100000"


def test_the_final_line_names_early_stopping(tmp_path, quiet_machine):
    trainer = tiny_trainer(tmp_path, max_epochs=5, stop_at_exact_match=0.5)
    trainer.state.stopped_early = True  # what a validation at the target sets
    assert trainer.stopped_by() == "stopped early: validation exact match reached 50.0% before max_epochs 5"


def test_the_cli_line_says_what_stopped_the_run(tmp_path, capsys, quiet_machine):
    from qkv.cli.train import _train

    trainer = tiny_trainer(tmp_path, max_steps=2)
    assert _train(trainer, str(tmp_path)) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trained ")]
    assert line.startswith("trained 2 steps (") and " on 1 process, stopped by max_steps (max_steps 2, " in line


# ----------------------------------------------------------------------------- a busy machine
def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "qkv.training.engine"]


def test_a_busy_machine_at_the_start_gets_one_hint(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(throughput_module, "machine_load", lambda: (3.9, 2))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with caplog.at_level(logging.INFO, logger="qkv"):
        tiny_trainer(tmp_path, max_steps=4).train()
    assert warnings_of(caplog) == ["the machine is busy (load 3.9 on 2 cores): try --threads 1"]


def test_steps_far_below_the_measured_peak_get_one_hint(tmp_path, monkeypatch, quiet_machine, caplog):
    # a peak no tiny model comes near: every window's MFU is far under SLOW_MFU
    monkeypatch.setattr(throughput_module, "peak_flops", lambda device, dtype: (1e16, "measured: a fake peak"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with caplog.at_level(logging.INFO, logger="qkv"):
        tiny_trainer(tmp_path, max_steps=5).train()
    hints = [r.getMessage() for r in caplog.records if "measured matmul peak on 2 threads" in r.getMessage()]
    assert len(hints) == 1 and hints[0].endswith("try --threads 1") and "load 0.1 on 2 cores" in hints[0]
    explained = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MFU (model FLOPs utilisation")]
    assert len(explained) == 1 and "this machine's measured matmul peak" in explained[0]


def test_an_idle_machine_at_its_peak_gets_no_hint(tmp_path, monkeypatch, quiet_machine, caplog):
    monkeypatch.setattr(throughput_module, "peak_flops", lambda device, dtype: (1e6, "measured: a tiny fake peak"))
    with caplog.at_level(logging.INFO, logger="qkv"):
        tiny_trainer(tmp_path, max_steps=4).train()
    assert warnings_of(caplog) == []


# ----------------------------------------------------------------------------- the cached peak
@pytest.fixture
def private_peaks(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    peaks.cpu_peak.cache_clear()
    yield
    peaks.cpu_peak.cache_clear()


class FakeMachine:
    """A load average and matmul rates to hand out, counting the measurements."""

    def __init__(self, monkeypatch, load: float, rates: list[float]) -> None:
        self.load, self.rates, self.measured = load, list(rates), 0
        monkeypatch.setattr(peaks, "machine_load", lambda: (self.load, 2))
        monkeypatch.setattr(peaks, "measure_matmul", self.measure)

    def measure(self, dtype, **kwargs):
        self.measured += 1
        return self.rates.pop(0), 1024


def peak_now(threads: int = 1) -> tuple[float, str]:
    peaks.cpu_peak.cache_clear()  # a new process
    return peaks.cpu_peak(torch.float32, threads)


def cached_entries() -> dict:
    path = peaks.cache_path()
    return json.loads(path.read_text())["peaks"] if path.is_file() else {}


def test_a_peak_measured_on_a_quiet_machine_is_cached_with_its_load(private_peaks, monkeypatch):
    machine = FakeMachine(monkeypatch, load=0.5, rates=[100e9])
    assert peak_now() == (100e9, "measured: 1024x1024 float32 torch.mm on 1 thread")
    (entry,) = cached_entries().values()
    assert entry["flops"] == 100e9 and entry["load"] == 0.5 and entry["cores"] == 2
    flops, source = peak_now()
    assert flops == 100e9 and "cached in" in source and machine.measured == 1


def test_a_peak_measured_under_load_is_used_once_and_never_cached(private_peaks, monkeypatch):
    machine = FakeMachine(monkeypatch, load=3.9, rates=[79e9, 80e9, 400e9])
    flops, source = peak_now(2)
    assert flops == 79e9 and "busy (load 3.9 on 2 cores; not cached)" in source and "2 threads" in source
    assert cached_entries() == {}
    assert peak_now(2)[0] == 80e9  # busy still: measured again
    machine.load = 0.3
    assert peak_now(2)[0] == 400e9 and machine.measured == 3
    assert [e["flops"] for e in cached_entries().values()] == [400e9]


@pytest.mark.parametrize(("old", "new", "kept"), [(79e9, 400e9, 400e9), (400e9, 300e9, 400e9)])
def test_an_entry_from_before_loads_were_recorded_is_measured_again_and_the_best_kept(
    private_peaks, monkeypatch, old, new, kept
):
    key = peaks.machine_key(torch.float32, 2)
    entry = {"flops": old, "size": 1024, "source": "measured: old", "date": "2026-12-02"}
    path = peaks.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "peaks": {key: entry}}))
    machine = FakeMachine(monkeypatch, load=0.2, rates=[new])
    assert peak_now(2)[0] == kept and machine.measured == 1
    assert cached_entries()[key]["flops"] == kept and cached_entries()[key]["load"] == 0.2
    assert peak_now(2)[0] == kept and machine.measured == 1  # now trusted: no third measurement


def test_machine_busy_is_load_above_the_cores():
    assert peaks.machine_busy(2.5, 2) and not peaks.machine_busy(2.0, 2) and not peaks.machine_busy(None, 2)


# ----------------------------------------------------------------------------- recipes' text
def test_recipes_show_dates_has_no_bf16_note_for_a_key_it_does_not_set():
    from qkv.cli.recipes import show_lines
    from qkv.runs.recipes import load_recipe

    recipe = load_recipe("dates")
    assert "bf16" not in recipe.train
    (line,) = [line for line in show_lines(recipe) if line.startswith("bf16 =")]
    assert line == "bf16 = false  # library default"


def test_recipes_show_notes_bf16_off_where_the_recipe_asks_for_it_and_it_is_slow(monkeypatch):
    from qkv.cli.recipes import show_lines
    from qkv.runs.recipes import load_recipe
    from qkv.runtime import precision

    recipe = load_recipe("multi30k")
    assert recipe.train.get("bf16") is True
    monkeypatch.setattr(precision, "bf16_is_fast", lambda device: False)
    monkeypatch.setattr(precision, "slow_bf16_reason", lambda device: "no AMX")
    (line,) = [line for line in show_lines(recipe) if line.startswith("bf16 =")]
    assert line == "bf16 = false  # off here: the recipe's true applies where bf16 is fast"


def test_the_dates_recipe_states_its_real_size_and_the_benchmarked_accuracy():
    from qkv.runs.recipes import load_recipe

    recipe = load_recipe("dates")
    vocab = recipe.vocab_size  # the tokenizer's at most; the real one (543) rounds the same
    model = Transformer(TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=0, **recipe.model))
    count = sum(p.numel() for p in model.parameters())
    assert f"{count / 1e6:.2f}M-parameter" in recipe.description
    result = json.loads((ROOT / "benchmarks/results/demo/demo_time.json").read_text())
    accuracy = f"{100 * result['runs'][0]['exact_match']:.1f}%"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "benchmarks/results/demo/demo_time.json" in readme and f"**{accuracy}** exact match" in readme
    assert accuracy in recipe.description
    assert f"reaches {accuracy}" in (ROOT / "src/qkv/cli/demo.py").read_text(encoding="utf-8")


def test_the_readme_loss_example_says_it_is_a_sum():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "summed over the 12 target tokens" in text
    torch.manual_seed(0)
    config = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=16, num_heads=2, d_ff=32)
    model = Transformer(config).eval()
    src, tgt = torch.randint(1, 50, (2, 9)), torch.randint(1, 50, (2, 7))
    summed = model.loss(src, tgt[:, :-1], tgt[:, 1:])
    logits = model(src, tgt[:, :-1])
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tgt[:, 1:].reshape(-1))
    assert tgt[:, 1:].numel() == 12 and torch.allclose(summed / 12, mean, atol=1e-5)


# ----------------------------------------------------------------------------- the benchmark's timer
needs_alarm = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timer here")


@pytest.fixture
def alarm_handler():
    """A handler of the test's own in place before the clock, put back after it; counts its calls."""
    calls = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@needs_alarm
def test_a_part_cut_by_the_whole_deadline_leaves_no_timer_armed(alarm_handler):
    clock = Clock(0.1)
    with clock:
        with pytest.raises(TimeUp) as up, clock.limit(30, "a long part"):
            while True:
                time.sleep(0.01)
        assert up.value.whole
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # not re-armed past the deadline
    assert signal.getsignal(signal.SIGALRM) is not clock._fire
    signal.raise_signal(signal.SIGALRM)  # reaches the handler from before the clock
    assert alarm_handler == [signal.SIGALRM]


@needs_alarm
def test_a_swallowed_timeup_past_the_whole_deadline_leaves_no_timer_armed(alarm_handler):
    with Clock(0.05) as clock:
        # the inner suppress swallows the timer's TimeUp, as a compiler's fallback may
        with pytest.raises(TimeUp) as up, clock.limit(30, "swallowed"), contextlib.suppress(TimeUp):
            time.sleep(1)
        assert up.value.whole
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_part_that_ends_past_the_whole_deadline_raises_at_its_end():
    clock = Clock(0.05, alarm=False)  # no timer: only the part's end can tell
    with pytest.raises(TimeUp) as up, clock.limit(30, "a part that overran the whole"):
        time.sleep(0.1)
    assert up.value.whole and up.value.what == "a part that overran the whole"


@needs_alarm
def test_the_timer_waits_for_a_finalizer_to_end(alarm_handler, monkeypatch):
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable.exc_value))

    ended: list[float] = []

    class SlowToDie:
        def __del__(self) -> None:
            time.sleep(0.2)  # the deadline passes in here
            ended.append(time.monotonic())

    clock, thing = Clock(0.05), SlowToDie()
    with pytest.raises(TimeUp), clock:
        del thing
        began = time.monotonic()
        while time.monotonic() < began + 2:  # bounded: a lost TimeUp must not hang the test
            time.sleep(0.01)
    assert lost == [] and len(ended) == 1 and time.monotonic() < ended[0] + 1


@needs_alarm
def test_a_stopped_clock_ignores_a_signal_on_its_way(alarm_handler):
    clock = Clock(60)
    with clock:
        pass
    clock._fire(signal.SIGALRM, None)  # what a signal delivered as stop() ran would call: no TimeUp
    assert signal.getsignal(signal.SIGALRM) is not clock._fire
