"""SIGKILL at random moments of a run that checkpoints every step (see tests/crash_trials.py):
after every kill ``qkv translate`` loads the run and ``--resume`` finishes it with the weights of an
uninterrupted run, bit for bit. 5 kills here; 100 with ``-m slow``."""

import crash_trials
import pytest


def trials(tmp_path, chains, kills_per_chain, steps=crash_trials.STEPS, window=1.0):
    src, tgt = crash_trials.write_data(tmp_path / "data")
    expected = crash_trials.uninterrupted(tmp_path, src, tgt, steps)
    kills = []
    for chain in range(chains):
        root = tmp_path / f"chain{chain}"
        root.mkdir()
        report = crash_trials.run_chain(
            root, src, tgt, expected, kills_per_chain, seed=chain, steps=steps, window=window
        )
        assert report.chain_final_equal, f"chain {chain}: the run killed {kills_per_chain} times ended elsewhere"
        kills += report.kills
    failures = [k for k in kills if not (k.translate_ok and k.resumed_equal)]
    assert not failures, failures
    return kills


def test_three_kills_lose_nothing(tmp_path):
    kills = trials(tmp_path, chains=1, kills_per_chain=3, steps=60, window=0.6)  # shorter: the default suite
    assert len(kills) == 3


@pytest.mark.slow
def test_a_hundred_kills_lose_nothing(tmp_path):
    kills = trials(tmp_path, chains=10, kills_per_chain=10)
    assert len(kills) == 100
    moments = {k.moment for k in kills}
    assert "between-saves" in moments or "mid-write" in moments  # the kills did land inside training


def test_sigterm_saves_the_last_whole_step_and_resume_finishes_the_run_exactly(tmp_path):
    """SIGTERM (``kill``, a scheduler's preemption) is handled like Ctrl-C: the run saves the step it
    has reached, though its periodic checkpoints are far apart, and exits 143 with one line saying
    how to resume; resuming ends on the uninterrupted run's weights. The old code died on the spot."""
    import signal
    import sys

    import torch

    steps = 60
    src, tgt = crash_trials.write_data(tmp_path / "data")
    expected = crash_trials.uninterrupted(tmp_path, src, tgt, steps)
    run = tmp_path / "terminated"
    argv = [*crash_trials.start_args(src, tgt, run, steps), "--checkpoint-every-steps", "1000"]
    proc, err, saved, trained = crash_trials.terminate_after_steps([sys.executable, "-m", "qkv", *argv], run, 5)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 5 <= trained <= saved < steps, err
    assert f"terminated (SIGTERM): checkpoint saved at step {saved}; continue with" in err and "Traceback" not in err
    assert crash_trials.quiet_main(crash_trials.resume_args(run)) == 0
    finished = crash_trials.final_weights(run)
    assert all(torch.equal(finished[name], tensor) for name, tensor in expected.items())
