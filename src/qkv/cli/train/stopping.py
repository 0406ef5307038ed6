"""One training session of ``qkv train``: the loop, with Ctrl-C, SIGTERM and a failed step each
reported in one line that says what the run folder holds and how to continue."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.training import Trainer


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a cluster scheduler's preemption, torchrun passing one on) during training:
    raised like Ctrl-C, so the trainer saves the last whole step before the process ends."""


@contextlib.contextmanager
def sigterm_saves_first() -> Iterator[None]:
    """While training, SIGTERM raises :class:`Terminated` in the main thread; a second SIGTERM is
    ignored so that it cannot cut the checkpoint short (SIGKILL still ends the process). Once the
    block is left, SIGTERM stays ignored until the caller's ``finally`` restores the old handler:
    the line that says what the run folder holds is printed even when torchrun's SIGTERM (after a
    lost rank) lands while it is being written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def sigterm_restored() -> Iterator[None]:
    """Put back the SIGTERM handler found on entry when the block ends (see :func:`sigterm_saves_first`)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def what_is_saved(run_dir: str, step: int) -> str:
    """What the run folder holds after a stop, read back from ``state.pt`` (a save that failed, on a
    full disk or with a process gone, leaves the previous checkpoint: say which step that is).

    Args:
        run_dir: the run folder.
        step: the step the stop meant to save.

    Returns:
        The words for the line that reports the stop, e.g. "checkpoint saved at step 120".
    """
    from qkv.training.checkpoint_files import saved_step

    on_disk = saved_step(run_dir)
    if on_disk == step:
        return f"checkpoint saved at step {step}"
    if on_disk is None:
        return f"the checkpoint of step {step} could not be saved and the run folder holds no readable one"
    return f"the checkpoint of step {step} could not be saved; the run folder holds step {on_disk}"


def train_and_report(trainer: Trainer, run_dir: str) -> int:
    """Run the loop; report Ctrl-C or SIGTERM and a failed step in one line each (rank 0 speaks for all).

    Args:
        trainer: the run's trainer, started or resumed.
        run_dir: the run folder, for the line that says how to continue.

    Returns:
        The exit code: 0 when the budget ended the run, 130 after Ctrl-C, 128 + SIGTERM after
        SIGTERM, 1 after a failed step.
    """
    from qkv.runs.translation import TrainingCrashed, run_training

    with sigterm_restored():
        try:
            with sigterm_saves_first():
                path = run_training(trainer)
        except KeyboardInterrupt as err:
            if trainer.dist.is_main:
                what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
                print(
                    f"{what}: {what_is_saved(run_dir, trainer.state.step)}; continue with "
                    f"qkv train --run-dir {run_dir} --resume",
                    file=sys.stderr,
                )
            return 128 + signal.SIGTERM if isinstance(err, Terminated) else 130
        except TrainingCrashed as err:
            print(
                f"qkv train: error: {err}; {what_is_saved(run_dir, err.step)}: after fixing the cause, "
                f"continue with qkv train --run-dir {run_dir} --resume",
                file=sys.stderr,
            )
            return 1
        s = trainer.state
        if trainer.dist.is_main:
            print(
                f"trained {s.step} step{'' if s.step == 1 else 's'} ({s.seconds / 60:.1f} min, "
                f"{s.tokens / max(s.seconds, 1e-9):.0f} target tokens/s) on {trainer.dist.world_size} "
                f"process{'' if trainer.dist.world_size == 1 else 'es'}, {trainer.stopped_by()}; wrote {path}",
                file=sys.stderr,
            )
        return 0
