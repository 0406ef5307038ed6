"""The application on a uvicorn server: what ``qkv serve`` runs, and what tests start on port 0.

uvicorn reads the requests (HTTP parsing, keep-alive, slow clients: each connection is a coroutine of
its own, so a client that stalls holds nothing but its own connection); the server binds to
127.0.0.1 unless told otherwise, and says so on stderr when it is not.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading

import uvicorn
from fastapi import FastAPI

from qkv.serve.app import create_app
from qkv.serve.models import Limits, ServedModel
from qkv.viz.app import ExplorerApp

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """A bound socket and the uvicorn server that will serve it.

    ``server_address`` is ``(host, port)`` as bound (port 0 picks a free one); ``serve_forever()``
    serves until ``shutdown()`` (from another thread) or Ctrl-C; ``server_close()`` closes the socket.
    """

    def __init__(self, app: FastAPI, host: str, port: int, *, log_level: str = "warning") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(2048)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop serving (from another thread) and wait for ``serve_forever`` to return."""
        self.uvicorn.should_exit = True
        self._stopped.wait(timeout)

    def server_close(self) -> None:
        self.socket.close()


def make_server(
    explorer: ExplorerApp,
    *,
    models: dict[str, ServedModel] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: Limits | None = None,
) -> Server:
    """Bind a server for ``models`` and the explorer ``explorer`` (without ``models``: the explorer's own
    models, each served by its kind). Raises ``OSError`` when the address cannot be bound."""
    from qkv.serve.models import served_model

    if models is None:
        models = {name: served_model(explorer_of) for name, explorer_of in explorer.explorers.items()}
    if not is_loopback(host):
        print(
            f"warning: serving on {host}: other machines on the network can reach this server "
            "(it has no authentication; bind 127.0.0.1 unless that is what you want)",
            file=sys.stderr,
            flush=True,
        )
    return Server(create_app(models, explorer, limits), host, port)
