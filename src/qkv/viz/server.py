"""``qkv serve``: the attention explorer as a small local web app (standard library HTTP server).

Routes:
    ``GET /``               the explorer page, in live mode, with one example already drawn
    ``GET /api/models``     ``{"models": [names], "max_chars": n}``
    ``POST /api/attend``    body ``{"text": str, "model": name}`` -> ``{"example": {...}}``

Only models named at start-up can be used; inputs are capped; a bad request gets a 4xx status and
``{"error": "<one line>"}``. The server binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from qkv.viz.export import explorer_data
from qkv.viz.html import render_html

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16_384
DEFAULT_MAX_CHARS = 500


class RequestError(Exception):
    """A client error: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ExplorerApp:
    """The server's logic, independent of HTTP (so it can be tested directly).

    Args:
        explorers: name -> an explorer from :func:`qkv.viz.explorers.open_explorer` (the first is
            the default model). Only these can be used.
        max_chars: the longest accepted input, in characters.
        initial_text: the sentence drawn when the page opens.
    """

    def __init__(self, *, explorers: dict, max_chars: int = DEFAULT_MAX_CHARS,
                 initial_text: str = "time flies like an arrow") -> None:
        if not explorers:
            raise ValueError("no models to serve")
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.explorers = dict(explorers)
        self.max_chars = max_chars
        self.initial_text = initial_text[:max_chars]
        self._lock = threading.Lock()  # one forward pass at a time; the models are not re-entrant
        self._page: str | None = None

    @property
    def model_names(self) -> list[str]:
        return list(self.explorers)

    def attend(self, payload: object) -> dict:
        """Validate a request body and return ``{"example": ...}``; raise :class:`RequestError`."""
        if not isinstance(payload, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object with 'text' (and 'model')")
        unknown = sorted(set(payload) - {"text", "model", "target"})
        if unknown:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"unknown fields {unknown}; expected 'text' and 'model'")
        text = payload.get("text")
        if not isinstance(text, str) or not text.strip():
            raise RequestError(HTTPStatus.BAD_REQUEST, "'text' must be a non-empty string")
        if len(text) > self.max_chars:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"'text' has {len(text)} characters; the limit is {self.max_chars}"
            )
        name = payload.get("model", self.model_names[0])
        if name not in self.explorers:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"unknown model {str(name)[:80]!r}; this server was started with: {', '.join(self.model_names)}",
            )
        explorer = self.explorers[name]
        target = payload.get("target")
        if target is not None and (explorer.kind != "seq2seq" or not isinstance(target, str)
                                   or len(target) > self.max_chars):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'target' must be a string, for a translation model only")
        try:
            with self._lock:
                example = explorer.example(text) if target is None else explorer.example(text, target)
        except ValueError as err:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(err).splitlines()[0]) from err
        return {"example": example}

    def page(self) -> str:
        """The live explorer page with the initial sentence drawn by the default model."""
        if self._page is None:
            first = self.explorers[self.model_names[0]]
            with self._lock:
                example = first.example(self.initial_text)
            live = {"models": self.model_names, "max_chars": self.max_chars, "endpoint": "/api/attend"}
            self._page = render_html(explorer_data([example], title="qkv attention explorer"), live=live)
        return self._page


class _Handler(BaseHTTPRequestHandler):
    server_version = "qkv-serve"
    app: ExplorerApp  # set on the subclass made by make_server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, self.app.page().encode("utf-8"), "text/html; charset=utf-8")
        elif path == "/api/models":
            self._json(HTTPStatus.OK, {"models": self.app.model_names, "max_chars": self.app.max_chars})
        elif path == "/api/attend":
            self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use POST with a JSON body"})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {path[:100]}"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            if path != "/api/attend":
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: {path[:100]}")
            payload = self._read_json()
            self._json(HTTPStatus.OK, self.app.attend(payload))
        except RequestError as err:
            self._json(err.status, {"error": err.message})
        except Exception:
            logger.exception("error while serving %s", path)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the server log"})

    def _read_json(self) -> object:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            size = int(length)
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length[:20]!r}") from None
        if size < 0 or size > MAX_BODY_BYTES:
            self.close_connection = True  # do not read an oversized body
            raise RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes; the limit is {MAX_BODY_BYTES}"
            )
        body = self.rfile.read(size)
        try:
            return json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON ({err})") from None

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload, ensure_ascii=False).encode("utf-8"), "application/json; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # route access logs through logging
        logger.debug("%s %s", self.address_string(), format % args)


def make_server(app: ExplorerApp, *, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """Bind an HTTP server for ``app`` (``port=0`` picks a free port; see ``server.server_address``).

    Call ``serve_forever()`` on the result, and ``shutdown()`` / ``server_close()`` to stop it.
    """
    if not _is_loopback(host):
        logger.warning("serving on %s: other machines on the network can reach this server", host)
    handler = type("ExplorerHandler", (_Handler,), {"app": app})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
