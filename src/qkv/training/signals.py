"""Signals held back while the training step updates the weights (:func:`signals_held`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back inside the block: one that comes is noted, and its handler runs
    when the block ends, so that an update of the weights and optimizer state is never cut in half.
    Done with Python-level handlers, not the thread's signal mask: the kernel hands a signal that the
    main thread blocks to another thread (torch and tqdm start some), whose C handler still makes
    Python run the handler in the main thread at once. Handlers set outside Python, and any thread
    but the main one (which cannot set handlers), leave the block unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, FrameType | None]] = []
    previous: dict[int, Callable[[int, FrameType | None], object] | int] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = handler
            signal.signal(signum, lambda number, frame: caught.append((number, frame)))
    try:
        yield
    finally:
        for number, saved in previous.items():
            signal.signal(number, saved)
        for number, frame in caught:
            saved = previous[number]
            if callable(saved):
                saved(number, frame)
            else:  # SIG_DFL: the default action, now
                signal.raise_signal(number)
