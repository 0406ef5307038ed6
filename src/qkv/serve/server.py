"""The application on a uvicorn server: what ``qkv serve`` runs, and what tests start on port 0.

uvicorn reads the requests (HTTP parsing, keep-alive: each connection is a coroutine of its own),
with the read timeouts and the connection cap of :mod:`qkv.serve.connections`. The server binds to
127.0.0.1 unless told otherwise, and says so on stderr when it is not; bound to a loopback address it
answers only requests whose Host is a loopback name (or one of ``allow_hosts``).

On SIGTERM or Ctrl-C (or :meth:`Server.shutdown`) the server drains: it stops accepting connections,
answers any new request on a connection already open 503 (``/health``: ``{"status": "draining"}``,
what a load balancer's readiness check reads) with ``Connection: close``, lets the requests in flight
(streamed generations included) finish within its drain timeout, cuts those still running then, and
stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import signal
import socket
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from qkv.serve.app import create_app
from qkv.serve.connections import ConnectionGuard, connection_cap, protocol_class
from qkv.serve.errors import LOOPBACK_NAMES, SECURITY_HEADERS
from qkv.serve.models import Limits, ServedModel
from qkv.viz.app import ExplorerApp

logger = logging.getLogger(__name__)


def show_address(host: str, port: int | None = None) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets: ``[::]:8000``)."""
    host = host or "0.0.0.0"  # an empty host binds every IPv4 address
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def allowed_hosts(host: str, allow: list[str] | None = None) -> list[str] | None:
    """The Host names a server bound to ``host`` answers: the loopback names and ``allow`` when bound
    to a loopback address; only ``allow`` (and the loopback names) when bound elsewhere with
    ``allow``; None (any name) when bound elsewhere without it."""
    if is_loopback(host):
        return [*LOOPBACK_NAMES, *(allow or [])]
    return [*LOOPBACK_NAMES, *allow] if allow else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost``, or a loopback IP address.

    Args:
        host: the address to bind, a name or an IPv4 or IPv6 address.

    Returns:
        True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``); False for any
        other name or address.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LISTEN_BACKLOG = 2048  # connections the kernel queues before accept (they hold no file descriptor yet)
DRAIN_TIMEOUT_S = 5.0  # a Server's drain timeout unless told (qkv serve's --drain-timeout, default 30)
LAST_CLOSE_S = 1  # after the drain, what uvicorn's own shutdown has at least to close the connections left
SHUTTING_DOWN = "the server is shutting down"
DRAIN_BODY_BYTES = 1 << 20  # a body read (and dropped) before a 503 of the drain; past it, answered unread
_ADOPTED: ContextVar[socket.socket | None] = ContextVar("qkv_serve_adopted_socket", default=None)


def bind_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (an IPv6 address: an IPv6 socket) and listening.

    Args:
        host: the address to bind.
        port: the port (0: a free one).
        backlog: the kernel's queue of connections not yet accepted.

    Returns:
        the listening socket (``SO_REUSEADDR``: a restarted server binds the port again at once).

    Raises:
        OSError: the address cannot be bound (taken, not this machine's).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def serving_on(sock: socket.socket) -> Iterator[None]:
    """Within this block a :class:`Server` (so :func:`make_server`) serves ``sock``, a socket already
    listening, instead of binding one: each worker process of ``qkv serve --workers`` serves the
    socket its parent bound.

    Args:
        sock: the listening socket.
    """
    token = _ADOPTED.set(sock)
    try:
        yield
    finally:
        _ADOPTED.reset(token)


class Drain:
    """Whether a server drains (set once, when it begins to stop): what :class:`DrainGuard` reads."""

    def __init__(self) -> None:
        self.draining = False


class DrainGuard:
    """ASGI middleware that answers every request 503 once its server drains: ``/health`` with
    ``{"status": "draining"}`` (a load balancer's readiness check then sends no more), any other with
    ``{"error": "the server is shutting down"}`` and ``Retry-After``; both with ``Connection: close``.
    The request's body is read first (up to :data:`DRAIN_BODY_BYTES`), so that a client still sending
    reads the answer rather than a reset. Before the drain it passes every request on untouched.

    Args:
        app: the application.
        drain: the server's drain flag.
    """

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining:
            await self.app(scope, receive, send)
            return
        read, more = 0, True
        while more and read <= DRAIN_BODY_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went: nobody to answer
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        health = scope.get("path") == "/health"
        body = json.dumps({"status": "draining"} if health else {"error": SHUTTING_DOWN}).encode()
        headers = [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *([] if health else [(b"retry-after", b"1")]),
            *SECURITY_HEADERS,
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, with:

    * its sockets' kernel queue widened once it listens: the event loop accepts at most ``backlog``
      connections at once (the guard's, small enough for the open-file limit), while a burst of
      connections waits in the kernel instead of being dropped;
    * a drain before uvicorn's own graceful shutdown (see the module): the listening sockets closed,
      new requests answered 503 by :class:`DrainGuard`, the requests in flight given until the drain
      timeout (``drain_timeout_s``) to finish, then uvicorn's shutdown cancelling those left;
    * SIGTERM handled as uvicorn handles it, but not raised again once the server has stopped: a
      process asked to stop that stops has succeeded (exit status 0). Ctrl-C is raised again
      (``KeyboardInterrupt``), as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout_s = drain, drain_timeout_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start as uvicorn does, then widen each socket's kernel queue to :data:`LISTEN_BACKLOG`."""
        await super().startup(sockets)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain (stop accepting, refuse new requests, wait for those in flight until the drain
        timeout or a second Ctrl-C), then shut down as uvicorn does with what is left of the timeout
        (at least :data:`LAST_CLOSE_S`): it closes the idle connections and cancels what still runs."""
        self.drain.draining = True
        for server in self.servers:
            server.close()  # stop accepting: a new connection is refused from now on
        for sock in sockets or []:
            sock.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while self.server_state.tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(math.ceil(deadline - loop.time()), LAST_CLOSE_S)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal handling (the first SIGINT or SIGTERM stops the server, a second Ctrl-C
        stops it at once), with SIGTERM left out of the signals uvicorn raises again afterwards."""
        with super().capture_signals():
            try:
                yield
            finally:  # uvicorn raises again what it captured once it has restored the old handlers
                captured = getattr(self, "_captured_signals", [])
                captured[:] = [sig for sig in captured if sig != signal.SIGTERM]


class Server:
    """A bound socket and the uvicorn server that will serve it.

    ``server_address`` is ``(host, port)`` as bound (port 0 picks a free one); ``serve_forever()``
    serves until ``shutdown()`` (from another thread), SIGTERM or Ctrl-C, each of which drains the
    server first (see the module; ``drain_timeout_s`` bounds it); ``server_close()`` closes the socket.
    Made within :func:`serving_on`, it serves that socket instead of binding one.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        log_level: str = "warning",
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        backlog = guard.backlog  # also how many the event loop accepts at once (connection_cap)
        adopted = _ADOPTED.get()
        self.socket = adopted if adopted is not None else bind_socket(host, port, backlog)
        self.server_address = self.socket.getsockname()[:2]
        self.guard = guard
        app.state.connections = guard
        self.drain = Drain()
        app.add_middleware(DrainGuard, drain=self.drain)  # the outermost: it answers before any other
        config = uvicorn.Config(
            app,
            http=protocol_class(guard),
            log_level=log_level,
            access_log=False,
            backlog=backlog,
            # the guard keeps the open connections at its cap; uvicorn's own count lags behind the
            # guard's closes by up to one accepted backlog, so its check (503 to a request) is set
            # past that: a backstop on the requests in progress
            limit_concurrency=guard.max_connections + guard.backlog + 1,
            timeout_keep_alive=5,
            h11_max_incomplete_event_size=16 * 1024,  # the request line and headers, at most
        )
        self.uvicorn = _UvicornServer(config, self.drain, drain_timeout_s)
        self._stopped = threading.Event()

    @property
    def drain_timeout_s(self) -> float:
        """Seconds the requests in flight have to finish once the server begins to stop."""
        return self.uvicorn.drain_timeout_s

    @drain_timeout_s.setter
    def drain_timeout_s(self, seconds: float) -> None:
        self.uvicorn.drain_timeout_s = seconds

    def serve_forever(self) -> None:
        """Serve on the bound socket, on this thread, until :meth:`shutdown` (from another thread),
        SIGTERM or Ctrl-C (both on the main thread only); :meth:`shutdown` waits for this to return."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop serving (from another thread): drain, then stop; wait for ``serve_forever`` to return
        (at most ``timeout`` seconds; default: the drain timeout and 5 s more)."""
        self.uvicorn.should_exit = True
        self._stopped.wait(self.drain_timeout_s + 5 if timeout is None else timeout)

    def server_close(self) -> None:
        """Close the listening socket (after :meth:`serve_forever` has returned)."""
        self.socket.close()


def make_server(
    explorer: ExplorerApp,
    *,
    models: dict[str, ServedModel] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: Limits | None = None,
    allow_hosts: list[str] | None = None,
    api_key: str | None = None,
    access_log: bool = True,
) -> Server:
    """Bind a server for ``models`` and the explorer ``explorer``.

    Args:
        explorer: the attention explorer.
        models: the models by name (default: the explorer's own, each served by its kind).
        host: the address to bind.
        port: the port (0: a free one).
        limits: what requests and connections may hold (default :class:`Limits`).
        allow_hosts: Host names to answer besides the loopback names (:func:`allowed_hosts`).
        api_key: the key every request but ``GET /health`` must send (None: none; :mod:`qkv.serve.access`).
        access_log: write a JSON line per request to the logger ``qkv.serve.access``.

    Returns:
        the bound server.

    Raises:
        OSError: the address cannot be bound. ValueError: ``limits.max_connections`` does not fit
            under the open-file limit.
    """
    from qkv.serve.models import served_model

    limits = limits or Limits()
    if models is None:
        models = {name: served_model(explorer_of) for name, explorer_of in explorer.explorers.items()}
    cap, backlog = connection_cap(limits.max_connections)
    guard = ConnectionGuard(
        max_connections=cap,
        backlog=backlog,
        header_timeout_s=limits.header_timeout_s,
        body_timeout_s=limits.body_timeout_s,
    )
    app = create_app(
        models, explorer, limits, allowed_hosts=allowed_hosts(host, allow_hosts), api_key=api_key, access_log=access_log
    )
    server = Server(app, host, port, guard=guard)
    if not is_loopback(host) and api_key is None:
        # a log record, not a print: ``qkv serve`` shows it on stderr, a program embedding the server decides
        logger.warning(
            "warning: serving on %s: other machines on the network can reach this server (it has no "
            "authentication; bind 127.0.0.1 unless that is what you want)",
            show_address(host, server.server_address[1]),
        )
    return server
