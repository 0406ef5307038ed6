"""The application on a uvicorn server: what ``qkv serve`` runs, and what tests start on port 0.

uvicorn reads the requests (HTTP parsing, keep-alive: each connection is a coroutine of its own),
with the read timeouts and the connection cap of :mod:`qkv.serve.connections`. The server binds to
127.0.0.1 unless told otherwise, and says so on stderr when it is not; bound to a loopback address it
answers only requests whose Host is a loopback name (or one of ``allow_hosts``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI

from qkv.serve.app import create_app
from qkv.serve.connections import ConnectionGuard, connection_cap, protocol_class
from qkv.serve.errors import LOOPBACK_NAMES
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


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, its sockets' kernel queue widened once it listens: the event loop accepts
    at most ``backlog`` connections at once (the guard's, small enough for the open-file limit), while
    a burst of connections waits in the kernel instead of being dropped."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)


class Server:
    """A bound socket and the uvicorn server that will serve it.

    ``server_address`` is ``(host, port)`` as bound (port 0 picks a free one); ``serve_forever()``
    serves until ``shutdown()`` (from another thread) or Ctrl-C; ``server_close()`` closes the socket.
    """

    def __init__(
        self, app: FastAPI, host: str, port: int, *, guard: ConnectionGuard, log_level: str = "warning"
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        backlog = guard.backlog  # also how many the event loop accepts at once (connection_cap)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(backlog)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()[:2]
        self.guard = guard
        app.state.connections = guard
        config = uvicorn.Config(
            app,
            http=protocol_class(guard),
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            backlog=backlog,
            # the guard keeps the open connections at its cap; uvicorn's own count lags behind the
            # guard's closes by up to one accepted backlog, so its check (503 to a request) is set
            # past that: a backstop on the requests in progress
            limit_concurrency=guard.max_connections + guard.backlog + 1,
            timeout_keep_alive=5,
            h11_max_incomplete_event_size=16 * 1024,  # the request line and headers, at most
        )
        self.uvicorn = _UvicornServer(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serve on the bound socket, on this thread, until :meth:`shutdown` (from another thread)
        or Ctrl-C; :meth:`shutdown` waits for this to return."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop serving (from another thread) and wait for ``serve_forever`` to return."""
        self.uvicorn.should_exit = True
        self._stopped.wait(timeout)

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
) -> Server:
    """Bind a server for ``models`` and the explorer ``explorer``.

    Args:
        explorer: the attention explorer.
        models: the models by name (default: the explorer's own, each served by its kind).
        host: the address to bind.
        port: the port (0: a free one).
        limits: what requests and connections may hold (default :class:`Limits`).
        allow_hosts: Host names to answer besides the loopback names (:func:`allowed_hosts`).

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
    app = create_app(models, explorer, limits, allowed_hosts=allowed_hosts(host, allow_hosts))
    server = Server(app, host, port, guard=guard)
    if not is_loopback(host):
        # a log record, not a print: ``qkv serve`` shows it on stderr, a program embedding the server decides
        logger.warning(
            "warning: serving on %s: other machines on the network can reach this server (it has no "
            "authentication; bind 127.0.0.1 unless that is what you want)",
            show_address(host, server.server_address[1]),
        )
    return server
