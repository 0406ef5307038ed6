"""``qkv serve``: the attention explorer as a small local web app (standard library HTTP server).

Routes:
    ``GET /``               the explorer page, in live mode, with one example already drawn
    ``GET /api/models``     ``{"models": [names], "max_chars": n}``
    ``POST /api/attend``    body ``{"text": str, "model": name}`` -> ``{"example": {...}}`` (with the
                            head statistics, labels, rollout and saliency of :mod:`qkv.viz.export`);
                            with ``"compare": str`` (a second sentence) -> ``{"example": first,
                            "examples": [first, second], "compare": {...}}``

Only models named at start-up can be used; inputs are capped; every error, whatever the method,
path or malformation, gets a 4xx/5xx status and ``{"error": "<one line>"}`` (never a traceback).
The server binds to 127.0.0.1 unless told otherwise. This module is the HTTP layer; what a request
means (validation, the models, the page) is :class:`qkv.viz.app.ExplorerApp`, re-exported here.

Limits (see :func:`make_server`):
    * ``timeout``: each request must arrive whole (request line, headers, body) within this many
      seconds of the server starting to read it, and the answer must be taken within it; a client
      that stalls gets ``408`` (if it had started a request) and is disconnected. One deadline per
      request, not per ``recv``, so a client trickling a byte at a time is cut off too.
    * ``max_concurrent``: connections served at once (reading, waiting for the model, writing).
      A connection beyond it is answered ``503`` with ``Retry-After`` at once (by a small pool of
      its own, so it is never queued behind the others). A stalled connection holds its slot for
      at most ``timeout`` (plus a 1 s lingering close), so slow clients cannot exhaust the slots
      for good; a client that reopens stalled connections as fast as they are dropped still can,
      for as long as it keeps at it (per-address limits would be the next step; this is a local
      tool, bound to 127.0.0.1 by default).
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import math
import re
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from qkv.viz.app import DEFAULT_MAX_CHARS, ExplorerApp, RequestError
from qkv.viz.connections import LINGER_S, RETRY_AFTER_S, ExplorerServer

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16_384
DEFAULT_TIMEOUT = 10.0  # seconds for a request to arrive (and for its answer to be taken)
DEFAULT_MAX_CONCURRENT = 32  # connections served at once
ROUTES = {  # path -> allowed methods
    "/": ("GET", "HEAD"),
    "/index.html": ("GET", "HEAD"),
    "/api/models": ("GET", "HEAD"),
    "/api/attend": ("POST",),
}


__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_TIMEOUT",
    "LINGER_S",
    "MAX_BODY_BYTES",
    "RETRY_AFTER_S",
    "ROUTES",
    "ExplorerApp",
    "ExplorerServer",
    "RequestError",
    "check_limits",
    "make_server",
]


def _one_line(message: str, limit: int = 300) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _DeadlineReader(io.RawIOBase):
    """A connection's input under one deadline per request: before each ``recv`` the socket's
    timeout is set to the time left, so the whole request, not each read, is bounded."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self.deadline = math.inf
        self.received = 0  # bytes of the current request
        self.timed_out = False

    def start(self, timeout: float) -> None:
        """A new request: ``timeout`` seconds from now."""
        self.deadline = time.monotonic() + timeout
        self.received = 0
        self.timed_out = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            self.timed_out = True
            raise
        self.received += n
        return n


class _Handler(BaseHTTPRequestHandler):
    """One connection. Every answer, http.server's own errors included, is JSON (or the page)."""

    server_version = "qkv-serve"
    app: ExplorerApp  # set on the subclass made by make_server
    timeout = DEFAULT_TIMEOUT  # likewise; StreamRequestHandler also puts it on the socket

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket file made by setup; reads go through the deadline instead
        self._input = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._input)

    def handle_one_request(self) -> None:
        """http.server's version, with a deadline, routes for every method, and a 408 for a stalled request."""
        self._input.start(self.timeout)
        self._responded = False
        self.command, self.request_version, self.requestline = "", "", ""  # errors before parsing carry headers
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG, "the request line is longer than 65,536 bytes")
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # it answered with send_error
                return
            self._route()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self._input.timed_out and self._input.received and not self._responded:
                try:
                    self._json(
                        HTTPStatus.REQUEST_TIMEOUT, {"error": f"the request did not arrive within {self.timeout:g} s"}
                    )
                    self.wfile.flush()
                except OSError:
                    pass  # the client is gone or not reading; closing is all there is left

    def _route(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            allowed = ROUTES.get(path)
            if allowed is None:
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such page: {path[:100]!r}")
            if self.command not in allowed:
                self._json(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    {"error": f"{self.command[:20]} is not allowed on {path}; use {' or '.join(allowed)}"},
                    headers={"Allow": ", ".join(allowed)},
                )
            elif path == "/api/attend":
                self._json(HTTPStatus.OK, self.app.attend(self._read_json()))
            elif path == "/api/models":
                self._json(HTTPStatus.OK, {"models": self.app.model_names, "max_chars": self.app.max_chars})
            else:
                self._send(HTTPStatus.OK, self.app.page().encode("utf-8"), "text/html; charset=utf-8")
        except RequestError as err:
            self._json(err.status, {"error": err.message})
        except (ConnectionError, TimeoutError):
            raise  # the connection failed: nothing can be answered
        except Exception:
            logger.exception("error while serving %s %s", self.command, path[:100])
            self.close_connection = True
            if not self._responded:
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the server log"})

    def _read_json(self) -> object:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        if not re.fullmatch(r"[0-9]{1,10}", length.strip()):
            self.close_connection = True  # the body's end is unknown
            raise RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length[:20]!r}")
        size = int(length)
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # do not read an oversized body
            raise RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes; the limit is {MAX_BODY_BYTES}"
            )
        try:
            body = self.rfile.read(size)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(
                HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within {self.timeout:g} s"
            ) from None
        if len(body) < size:
            self.close_connection = True
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"the body ended after {len(body)} bytes; Content-Length said {size}"
            )
        try:
            return json.loads(body.decode("utf-8"))
        except RecursionError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not valid JSON (nested too deeply)") from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
            raise RequestError(HTTPStatus.BAD_REQUEST, _one_line(f"the body is not valid JSON ({err})")) from None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, HTTP version, headers) as JSON, not HTML."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._json(code, {"error": _one_line(message or phrase)})

    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        text = json.dumps(payload, ensure_ascii=False)
        try:
            body = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate quoted in a message: escape it instead
            body = json.dumps(payload).encode("ascii")
        self._send(status, body, "application/json; charset=utf-8", headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # always send a status line and headers
        self.connection.settimeout(self.timeout)  # the answer gets the whole timeout to be taken
        self._responded = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        # no other site may frame the explorer (a policy in the page's meta cannot say that)
        self.send_header("Content-Security-Policy", "frame-ancestors 'none'")
        self.send_header("X-Frame-Options", "DENY")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # HEAD: the headers GET would send, no body
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # route access logs through logging
        logger.debug("%s %s", self.address_string(), format % args)


def check_limits(*, timeout: float, max_concurrent: int) -> None:
    """Raise ValueError unless ``timeout`` is a positive number of seconds and ``max_concurrent`` a positive integer."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f"max_concurrent must be a positive integer, got {max_concurrent!r}")


def make_server(
    app: ExplorerApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout: float = DEFAULT_TIMEOUT,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
) -> ExplorerServer:
    """Bind an HTTP server for ``app`` (``port=0`` picks a free port; see ``server.server_address``).

    Args:
        timeout: seconds for a request to arrive whole, and for its answer to be taken.
        max_concurrent: connections served at once; more get 503 with ``Retry-After``.

    Call ``serve_forever()`` on the result, and ``shutdown()`` / ``server_close()`` to stop it.
    """
    check_limits(timeout=timeout, max_concurrent=max_concurrent)
    if not _is_loopback(host):
        logger.warning("serving on %s: other machines on the network can reach this server", host)
    handler = type("ExplorerHandler", (_Handler,), {"app": app, "timeout": timeout})
    return ExplorerServer((host, port), handler, max_concurrent=max_concurrent, timeout=timeout)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
