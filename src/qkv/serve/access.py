"""Who may call ``qkv serve`` and what it writes of each request: the API key and the access log.

* :class:`ApiKeyGuard`: with a key, every request but ``GET /health`` must carry it, as
  ``Authorization: Bearer KEY`` (what the OpenAI clients send) or ``X-API-Key: KEY``; without it, or
  with another, 401 with ``WWW-Authenticate: Bearer``, before the body is read.
* :class:`AccessLog`: gives each request an id (its ``X-Request-Id`` when short and printable, else a
  new one; echoed in the answer), counts it in the :class:`~qkv.serve.metrics.ServerMetrics` and
  writes one JSON line for it to the logger ``qkv.serve.access`` once its answer's last byte is sent
  (a streamed answer when its stream ends). A line holds no body, no query string, no header.

Both are plain ASGI middleware, as :class:`~qkv.serve.errors.RequestGuard` is, so that a streamed
answer goes out as it is written and a client that goes still cancels its work.
"""

from __future__ import annotations

import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone

from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qkv.serve.errors import SECURITY_HEADERS, error_response, is_openai_path, openai_error_response
from qkv.serve.metrics import ServerMetrics

ACCESS_LOGGER = "qkv.serve.access"
KEY_VARIABLE = "QKV_API_KEY"
OPEN_ROUTES = frozenset({("GET", "/health")})  # readiness probes carry no key
MAX_REQUEST_ID = 128

access_logger = logging.getLogger(ACCESS_LOGGER)


def _printable(value: str | bytes) -> bool:
    """Whether ``value`` is visible ASCII only (no space, no control character)."""
    data = value.encode("utf-8") if isinstance(value, str) else value
    return bool(data) and all(0x21 <= byte <= 0x7E for byte in data)


def api_key_of(flag: str | None, environ: Mapping[str, str], *, host: str, loopback: bool, waived: bool) -> str | None:
    """The key ``qkv serve`` asks for: ``--api-key``'s, else ``$QKV_API_KEY``'s, else none.

    Args:
        flag: the ``--api-key`` value (None: not given).
        environ: the environment (``QKV_API_KEY``; an empty value is no key).
        host: the address the server binds, named in the error.
        loopback: whether ``host`` is this machine only.
        waived: ``--no-api-key`` was given: serve without a key, whatever the environment says.

    Returns:
        The key, or None to serve without one.

    Raises:
        ValueError: both ``--api-key`` and ``--no-api-key``; a key that a header cannot carry; no key
            for an address beyond this machine without ``--no-api-key`` (the message never holds a key).
    """
    if waived:
        if flag is not None:
            raise ValueError("--api-key and --no-api-key contradict each other; give one of them")
        return None
    key = flag if flag is not None else environ.get(KEY_VARIABLE) or None
    if key is not None and not _printable(key):
        source = "--api-key" if flag is not None else KEY_VARIABLE
        raise ValueError(f"{source} must be visible ASCII characters only (no spaces), as an HTTP header carries it")
    if key is None and not loopback:
        raise ValueError(
            f"serving on {host} lets other machines reach the server: set {KEY_VARIABLE} (or pass --api-key), "
            "or pass --no-api-key to serve without a key"
        )
    return key


class ApiKeyGuard:
    """ASGI middleware: 401 for a request without the server's key (but ``GET /health``).

    The key is compared with :func:`hmac.compare_digest` (in constant time), from ``Authorization:
    Bearer KEY`` or ``X-API-Key: KEY``. The refusal is one line of JSON (OpenAI's error object on the
    OpenAI paths, :func:`qkv.serve.errors.is_openai_path`), with ``WWW-Authenticate: Bearer`` and the
    security headers, sent before the body is read.

    Args:
        app: the application it guards.
        api_key: the key.
        open_routes: ``(method, path)`` pairs answered without a key.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_routes: Collection[tuple[str, str]] = OPEN_ROUTES) -> None:
        if not _printable(api_key):
            raise ValueError("the API key must be visible ASCII characters only (no spaces)")
        self.app = app
        self.key = api_key.encode("ascii")
        self.open_routes = frozenset(open_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if (scope.get("method"), scope.get("path")) in self.open_routes:
            await self.app(scope, receive, send)
            return
        found = self._offered(scope)
        if any(hmac.compare_digest(offered, self.key) for offered in found):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if found:
            message = "invalid API key"
        else:
            message = "missing API key: send it as Authorization: Bearer <key> (or X-API-Key: <key>)"
        headers = {"WWW-Authenticate": "Bearer"}
        path = scope.get("path", "")
        if is_openai_path(path):  # OpenAI's error shape, with its code for a key
            response: JSONResponse = openai_error_response(401, message, code="invalid_api_key", headers=headers)
        else:
            response = error_response(401, message, headers)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await response(scope, receive, send_with_headers)

    @staticmethod
    def _offered(scope: Scope) -> list[bytes]:
        """The keys a request offers: its bearer token and its ``X-API-Key``, those it has."""
        offered = []
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    offered.append(token.strip())
                else:
                    offered.append(b"")  # another scheme: a key offered, not the server's
            elif name == b"x-api-key":
                offered.append(value.strip())
        return offered


def request_id_of(scope: Scope) -> str:
    """The request's id: its ``X-Request-Id`` when at most 128 visible ASCII characters, else a new
    uuid4 in hex (a client's id may tie its own logs to the server's)."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id" and len(value) <= MAX_REQUEST_ID and _printable(value):
            return value.decode("ascii")
    return uuid.uuid4().hex


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    if not client:
        return None
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class AccessLog:
    """ASGI middleware: a request id for each request (echoed as ``X-Request-Id``), its count and
    duration in ``metrics``, and one JSON line for it on the logger ``qkv.serve.access`` (at INFO):
    ``time`` (its arrival, ISO 8601 UTC), ``client``, ``method``, ``path`` (without its query),
    ``status``, ``duration_ms``, ``bytes`` (of the answer's body) and ``request_id``.

    Args:
        app: the application (with the other middleware) it wraps.
        metrics: where requests are counted (None: nowhere).
        routes: the application's routes, whose templates label the metrics (read at each request).
        log: write the access log (False: ids and metrics only).
    """

    def __init__(
        self, app: ASGIApp, metrics: ServerMetrics | None = None, routes: Sequence[BaseRoute] = (), log: bool = True
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived, started = datetime.now(timezone.utc), time.perf_counter()
        request_id = request_id_of(scope)
        status, sent = 0, 0

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode("ascii"))]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            status = status or 500  # nothing was answered: the application failed
            method = str(scope.get("method", ""))
            if self.metrics is not None:
                self.metrics.observe_request(method, self._route(scope), status, seconds)
            if self.log and access_logger.isEnabledFor(logging.INFO):
                record = {
                    "time": arrived.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                    "client": _client(scope),
                    "method": method[:20],
                    "path": str(scope.get("path", ""))[:300],
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                    "bytes": sent,
                    "request_id": request_id,
                }
                access_logger.info(json.dumps(record, ensure_ascii=True))

    def _route(self, scope: Scope) -> str | None:
        """The template of the route the request went to (or would have: a request refused before
        routing, a method the route does not take), or None for a path no route takes."""
        route = scope.get("route")
        if route is not None and getattr(route, "path", None):
            return str(route.path)
        for candidate in self.routes:
            match, _ = candidate.matches(scope)
            path = getattr(candidate, "path", None)
            if match != Match.NONE and path:
                return str(path)
        return None


_installed: list[logging.Handler] = []  # the handler open_access_log added, if any


def open_access_log(target: str | None) -> None:
    """Send the access log (logger ``qkv.serve.access``) to ``target``: ``-`` for stderr, else a file
    appended to; one JSON object a line. It replaces what an earlier call set up; :func:`close_access_log`
    undoes it.

    Args:
        target: ``-``, a file path, or None (no access log: only an earlier call's target is closed).

    Raises:
        ValueError: the file cannot be opened (the message names ``--access-log``).
    """
    close_access_log()
    if target is None:
        return
    handler: logging.Handler
    if target == "-":
        handler = logging.StreamHandler(sys.stderr)
    else:
        try:
            handler = logging.FileHandler(target, encoding="utf-8")
        except OSError as err:
            raise ValueError(f"--access-log {target}: cannot open it ({err.strerror or err})") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_logger.addHandler(handler)
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False  # its lines go to their target only, not to the root logger's stderr too
    _installed.append(handler)


def close_access_log() -> None:
    """Remove and close the handler :func:`open_access_log` added (none: nothing to do)."""
    while _installed:
        handler = _installed.pop()
        access_logger.removeHandler(handler)
        handler.close()
        access_logger.propagate = True
        access_logger.setLevel(logging.NOTSET)
