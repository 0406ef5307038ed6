"""What one connection may hold: read timeouts, and a cap on open connections below the open-file limit.

uvicorn times out only a keep-alive connection that sends nothing after an answer; a connection that
opens and sends nothing, or part of its headers, or part of its body, is otherwise held until its
client goes, and each one holds a file descriptor. :class:`GuardedH11Protocol` (uvicorn's h11
protocol, with what it lacks) adds:

* a **header timeout**: a connection has ``header_timeout_s`` to send a request's headers, counted
  from when it opens or from the end of its previous answer;
* a **body timeout**: then ``body_timeout_s`` to send the body;
* a **connection cap**: past ``max_connections`` open connections, a new one closes the connection
  that has waited longest for its client (one that is sending a request or idle between requests,
  never one whose request is being answered); when every other connection is being answered, the
  new one gets 503 and is closed at once. The event loop accepts at most its backlog of connections
  before the cap counts them, so the process never holds more sockets than the cap plus the
  backlog, and ``accept`` cannot run out of file descriptors (``EMFILE``): :func:`connection_cap`
  keeps both under the open-file limit.

A connection that times out gets ``408`` (or, past the cap, ``503``) as one line of JSON, then is closed.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# file descriptors left for what the server opens after it starts: logs, a model's files, the
# event loop's own, the model thread's
FD_RESERVE = 64
# what a platform without getrlimit (Windows) is taken to allow
FALLBACK_FD_LIMIT = 512


def open_file_limit() -> int:
    """The process's soft limit on open files (``ulimit -n``)."""
    try:
        import resource
    except ImportError:  # Windows
        return FALLBACK_FD_LIMIT
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return FALLBACK_FD_LIMIT * 2048 if soft == resource.RLIM_INFINITY else int(soft)


def open_files() -> int:
    """How many file descriptors the process holds now (an estimate where ``/proc`` is missing)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 32


def accept_backlog(room: int) -> int:
    """How many connections the event loop may accept at once (its listen backlog) out of ``room``
    free file descriptors: it accepts that many before the first of them is counted against the cap."""
    return max(1, min(128, room // 8))


def connection_cap(requested: int | None = None) -> tuple[int, int]:
    """The most connections the server may hold open, and its accept backlog: together they stay
    within the open-file limit, less the files open now and :data:`FD_RESERVE`.

    Args:
        requested: a cap asked for (``--max-connections``); None: the largest that fits.

    Returns:
        ``(cap, backlog)``.

    Raises:
        ValueError: the cap asked for does not fit under the open-file limit, or none does.
    """
    limit, in_use = open_file_limit(), open_files()
    room = limit - in_use - FD_RESERVE
    where = f"the open-file limit (ulimit -n) is {limit}, {in_use} files are open and {FD_RESERVE} are kept in reserve"
    backlog = accept_backlog(room)
    if room - backlog < 1:
        raise ValueError(f"no room for connections: {where}; raise the limit with ulimit -n")
    if requested is None:
        return room - backlog, backlog
    if requested > room - backlog:
        raise ValueError(f"--max-connections {requested} does not fit: {where}, so at most {room - backlog}")
    return requested, backlog


@dataclass
class ConnectionGuard:
    """The limits every connection of one server is held to, and what they did (``/health`` shows it)."""

    max_connections: int
    backlog: int = 128  # connections accepted at once, before the cap counts them
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    timed_out: int = 0  # connections closed for a header or body not sent in time
    evicted: int = 0  # stalled or idle connections closed to make room for a new one
    refused: int = 0  # new connections refused (503) because every other one was being answered

    def __post_init__(self) -> None:
        # the connections open now, less those closed here whose close has not yet reached uvicorn
        # (its own count lags: a connection leaves it on the next turn of the event loop)
        self.live: set[GuardedH11Protocol] = set()

    def report(self) -> dict[str, Any]:
        """What ``/health`` shows of the connections."""
        return {
            "open": len(self.live),
            "max": self.max_connections,
            "timed_out": self.timed_out,
            "evicted": self.evicted,
            "refused": self.refused,
        }


def raw_error(status: int, reason: str, message: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer ``{"error": message}`` that closes the connection, for a connection that
    has no request (or no complete one) to answer through the application."""
    body = json.dumps({"error": message}).encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json; charset=utf-8",
        f"content-length: {len(body)}",
        "connection: close",
        "x-content-type-options: nosniff",
        *(f"{name}: {value}" for name, value in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body read timeouts and the connection cap of ``guard``
    (set on a subclass: :func:`protocol_class`)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count a new connection against the cap (closing the one that has waited longest for its
        client, or answering this one 503 and closing it when every other is being answered), then
        start its header timeout.

        Args:
            transport: the new connection's transport.
        """
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers" or "body": what the timer waits for
        self._waiting_since = self.loop.time()
        self.guard.live.add(self)
        if len(self.guard.live) > self.guard.max_connections and not self._evict_one():
            self.guard.refused += 1
            message = f"the server holds {self.guard.max_connections} connections, its limit; retry later"
            transport.write(raw_error(503, "Service Unavailable", message, (("retry-after", "1"),)))
            self._close()
            return
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop counting the connection and cancel its read timer, then let uvicorn close it.

        Args:
            exc: the error that ended the connection, or None for a clean close.
        """
        self.guard.live.discard(self)
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        """Handle what the client sent, as uvicorn does, then re-arm the read timer for what the
        connection now waits for (the body once the headers are in; none while it is answered)."""
        super().handle_events()
        self._follow_state()

    def on_response_complete(self) -> None:
        """Finish an answer, as uvicorn does, then re-arm the read timer: on a connection kept
        alive, the header timeout of its next request."""
        super().on_response_complete()
        self._follow_state()

    def _stalled(self) -> bool:
        """Waiting for its client (a request to come, or the rest of one), not being answered."""
        if self.transport.is_closing():
            return False
        answering = self.cycle is not None and not self.cycle.response_complete and self.conn.their_state is h11.DONE
        return not answering and self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for its client; False when there is none."""
        others = [c for c in self.guard.live if c is not self and c._stalled()]
        if not others:
            return False
        oldest = min(others, key=lambda c: c._waiting_since)
        self.guard.evicted += 1
        oldest._close()
        return True

    def _close(self) -> None:
        self.guard.live.discard(self)
        self._disarm()
        self.transport.close()

    def _follow_state(self) -> None:
        """Arm the timer for what the connection now waits for from its client, or none."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            wanted: str | None = "headers"
        elif state is h11.SEND_BODY:
            wanted = "body"
        else:
            wanted = None
        if wanted == self._reading:
            return
        self._disarm()
        if wanted is not None:
            delay = self.guard.header_timeout_s if wanted == "headers" else self.guard.body_timeout_s
            self._reading, self._waiting_since = wanted, self.loop.time()
            self._read_timer = self.loop.call_later(delay, self._timed_out, wanted)

    def _disarm(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
        self._read_timer, self._reading = None, None

    def _timed_out(self, what: str) -> None:
        self._read_timer, self._reading = None, None
        if self.transport.is_closing():
            return
        self.guard.timed_out += 1
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            seconds = self.guard.header_timeout_s if what == "headers" else self.guard.body_timeout_s
            message = f"the request's {what} did not arrive within {seconds:g} s"
            self.transport.write(raw_error(408, "Request Timeout", message))
        self._close()  # the application, if it was reading the body, sees the client go


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn makes each connection of, held to ``guard``."""
    return type("QkvH11Protocol", (GuardedH11Protocol,), {"guard": guard})
