"""A wall-clock budget for a benchmark that must end in time, whatever it is doing.

:class:`Clock` holds the deadline of a whole run. The benchmark asks it between measurements
(:meth:`Clock.check`) and, as a backstop, an interval timer (``SIGALRM``) interrupts whatever runs
when the deadline passes: a compilation that takes minutes, a step that hangs. :meth:`Clock.limit`
sets a tighter deadline for one part (a ``torch.compile`` warm-up), after which the run goes on.

Both raise :class:`TimeUp`, a ``BaseException`` so that library code catching ``Exception`` (a
compiler's error handling) lets it through. Where the timer fires inside C code that turns the
exception into another (PyTorch's argument parsing makes it a ``TypeError``, which the compiler may
then swallow and fall back on), :meth:`Clock.limit` still raises ``TimeUp`` when its block ends. The timer works in the main thread of a POSIX process;
elsewhere only the checks between measurements stop the run.

Nothing of the timer outlives the clock: leaving ``with clock:`` (or :meth:`Clock.stop`) disarms it and
puts back the previous handler even when the timer fires during the exit, a signal still on its way
then is ignored, and a part that ends past the whole deadline raises at once instead of re-arming.
Where the timer fires inside a finalizer (``__del__``, which cannot pass an exception on: Python
would report it as unraisable and carry on), it fires again just after instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

FINALIZER_RETRY_S = 0.01  # the timer fired inside a finalizer: fire again this much later, outside it


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` (where a signal handler interrupted the program) runs inside a ``__del__``."""
    depth = 0
    while frame is not None and depth < 200:
        if frame.f_code.co_name == "__del__":
            return True
        frame, depth = frame.f_back, depth + 1
    return False


class TimeUp(BaseException):  # noqa: N818  (a signal of time, like KeyboardInterrupt, not an error)
    """The budget (``whole=True``) or one part's limit ran out while ``what`` was running."""

    def __init__(self, what: str, *, whole: bool) -> None:
        super().__init__(what)
        self.what = what
        self.whole = whole


class Clock:
    """The deadline of a run that started at ``started`` (``time.monotonic()``) and may last
    ``seconds``.

    Args:
        seconds: the whole budget.
        started: when the run began (default: now); a script passes the time it was started at,
            so that imports count.
        alarm: interrupt running work at the deadline (``SIGALRM``), where the platform allows it.
    """

    def __init__(self, seconds: float, *, started: float | None = None, alarm: bool = True) -> None:
        if seconds <= 0:
            raise ValueError(f"the time budget must be positive, got {seconds} s")
        self.started = time.monotonic() if started is None else started
        self.deadline = self.started + seconds
        self.doing = "starting"  # what runs now, named in TimeUp
        self._part: float | None = None  # a part's own deadline, when tighter than the whole's
        self._alarm = alarm and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self._fired: TimeUp | None = None  # what the timer raised inside the current part
        self._previous: object = None
        self._installed = False  # the handler is in place (inside ``with clock:``)

    def elapsed(self) -> float:
        """Seconds since the clock started."""
        return time.monotonic() - self.started

    def left(self) -> float:
        """Seconds until the whole deadline (negative once past)."""
        return self.deadline - time.monotonic()

    def check(self, doing: str) -> None:
        """Note that ``doing`` starts now; raise :class:`TimeUp` when the budget is spent."""
        self.doing = doing
        if self.left() <= 0:
            raise TimeUp(doing, whole=True)

    def _fire(self, signum: int, frame: FrameType | None) -> None:
        if not self._installed:  # a signal that was on its way while the clock stopped: nothing runs under it
            return
        if _in_finalizer(frame):  # an exception raised there is lost (Python reports it as unraisable)
            signal.setitimer(signal.ITIMER_REAL, FINALIZER_RETRY_S)
            return
        whole = self._part is None or self.left() <= 0.05
        self._fired = TimeUp(self.doing, whole=whole)
        raise self._fired

    def _arm(self) -> None:
        if not (self._alarm and self._installed):
            return
        until = self.deadline if self._part is None else min(self._part, self.deadline)
        signal.setitimer(signal.ITIMER_REAL, max(until - time.monotonic(), 1e-3))

    def __enter__(self) -> Clock:
        if self._alarm and not self._installed:  # entered again: keep the handler found the first time
            self._previous = signal.signal(signal.SIGALRM, self._fire)
            self._installed = True
            self._arm()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:  # the timer fired as stop() began, before it changed anything: disarm now
            self.stop()

    def stop(self) -> None:
        """Disarm the timer and put back the ``SIGALRM`` handler found on entry (the run is writing its
        last result); safe to call twice. Once it has begun, a signal still on its way is ignored."""
        if self._installed:
            self._installed = False  # first: _fire ignores a signal from here on
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
            finally:
                signal.signal(signal.SIGALRM, self._previous)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def limit(self, seconds: float, doing: str) -> Iterator[None]:
        """Run the block with at most ``seconds`` of its own (and never past the whole deadline).
        Its overrun raises :class:`TimeUp` with ``whole=False``; the whole budget's, ``whole=True``."""
        self.check(doing)
        self._part = time.monotonic() + max(seconds, 0.0)
        self._fired = None
        self._arm()
        try:
            if time.monotonic() >= self._part:
                raise TimeUp(doing, whole=False)
            yield
        except TimeUp:
            raise
        except BaseException as err:  # the timer's TimeUp, turned into another exception on its way up
            if self._fired is not None:
                raise self._fired from err
            raise
        else:
            if self._fired is not None:  # fired, and swallowed by the code it interrupted
                raise self._fired
        finally:
            self._fired = None
            self._part = None
            if self.left() > 0:
                self._arm()  # back to the whole deadline
            elif self._alarm and self._installed:  # past it: the block's TimeUp, or the check below, ends the run
                signal.setitimer(signal.ITIMER_REAL, 0)
        self.check(doing)  # the block ended in time, the whole budget with it
