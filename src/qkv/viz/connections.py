"""The explorer server's connections: at most ``max_concurrent`` served at once, each on a thread
of its own; beyond that a connection is answered 503 at once (see :mod:`qkv.viz.server` for the
limits and why), and every connection is closed after a lingering read.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeAlias

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client turned away with 503 is told to wait
LINGER_S = 1.0  # after answering, how long to read what a client still sends, so closing does not reset it

# what socketserver hands a server per connection: the socket (TCP, as here), or (data, socket) for UDP
Request: TypeAlias = "socket.socket | tuple[bytes, socket.socket]"


class ExplorerServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_concurrent`` of them; beyond that a connection is
    answered 503 at once by a small pool of its own (or, if that is full too, by the accepting
    thread without waiting), so a flood neither queues nor grows threads without bound.

    ``active_connections`` is the number of connections being served.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default, 5, drops connections in a burst)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_concurrent: int,
        timeout: float,
    ) -> None:
        super().__init__(address, handler)
        self.max_concurrent = max_concurrent
        self.read_timeout = timeout
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._rejecters = threading.BoundedSemaphore(max_concurrent)
        self._count_lock = threading.Lock()
        self._active = 0
        body = json.dumps(
            {"error": f"the server is busy ({max_concurrent} connections being served); retry in {RETRY_AFTER_S} s"}
        ).encode("utf-8")
        self._busy_answer = (
            f"HTTP/1.0 503 Service Unavailable\r\nServer: {handler.server_version}\r\n"
            f"Content-Type: application/json; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
            f"Connection: close\r\n\r\n"
        ).encode("latin-1") + body

    @property
    def active_connections(self) -> int:
        return self._active

    def process_request(self, request: Request, client_address: object) -> None:
        if self._slots.acquire(blocking=False):
            with self._count_lock:
                self._active += 1
            self._start(self._serve, request, client_address)
        elif self._rejecters.acquire(blocking=False):
            self._start(self._reject, request, client_address)
        else:
            self._answer_busy(request, linger=False)

    def _start(self, target: Callable[[Request, object], None], request: Request, client_address: object) -> None:
        try:
            threading.Thread(target=target, args=(request, client_address), daemon=True).start()
        except RuntimeError:  # no more threads
            logger.warning("cannot start a thread for %s; closing its connection", client_address)
            (self._release_slot if target == self._serve else self._rejecters.release)()
            self._answer_busy(request, linger=False)

    def _release_slot(self) -> None:
        with self._count_lock:
            self._active -= 1
        self._slots.release()

    def _serve(self, request: Request, client_address: object) -> None:
        try:
            self.process_request_thread(request, client_address)  # handles, then shutdown_request
        finally:
            self._release_slot()

    def _reject(self, request: Request, client_address: object) -> None:
        try:
            self._answer_busy(request, linger=True)
        finally:
            self._rejecters.release()

    def _answer_busy(self, request: Request, *, linger: bool) -> None:
        logger.debug("busy: turned a connection away with 503")
        sock = _socket_of(request)
        try:
            sock.settimeout(min(self.read_timeout, LINGER_S))
            sock.sendall(self._busy_answer)
        except OSError:
            pass
        if linger:
            self.shutdown_request(request)
        else:
            self.close_request(request)

    def shutdown_request(self, request: Request) -> None:
        """Close after a lingering read: a socket closed with unread input resets the connection,
        and the client may then lose the answer it was sent (e.g. a 413 before its body was read)."""
        sock = _socket_of(request)
        try:
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + min(self.read_timeout, LINGER_S)
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(65536):
                    break
        except OSError:
            pass
        self.close_request(request)

    def handle_error(self, request: Request, client_address: object) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            logger.debug("connection from %s ended: %r", client_address, err)
        else:
            logger.exception("error while serving %s", client_address)


def _socket_of(request: Request) -> socket.socket:
    """The connection's socket: a TCP server's request is the socket itself."""
    return request if isinstance(request, socket.socket) else request[1]
