"""Every error of the server as JSON ``{"error": "<one line>"}`` with its status, and the middleware
that checks requests (Host, Content-Type, body size) and adds the security headers to every answer.

* a client's mistake the routes find: :class:`ApiError` (status, message);
* a request the schema refuses: 422, naming the field (malformed JSON: 400);
* before the application: a Host not among the server's names: 421; a body not sent as
  ``application/json``: 415; a body over the limit: 413 (:class:`RequestGuard`);
* an unknown path: 404; a method the path does not take: 405 with ``Allow``;
* anything else: 500 ``internal error; see the server log`` (the traceback goes to the log, once).

On the OpenAI-compatible routes (:func:`is_openai_path`) every one of them is in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}`` (:func:`openai_error_response`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
    # no other site may frame the explorer (a policy in the page's meta cannot say that)
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
]


class ApiError(Exception):
    """A client error the routes find: an HTTP status, a one-line message and any headers to send."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def one_line(message: object, limit: int = 300) -> str:
    """``message`` as one line: its whitespace (newlines included) collapsed to single spaces, cut
    to ``limit`` characters with ``...`` at the end when longer.

    Args:
        message: the error or text to write (``str`` of it is taken).
        limit: the longest line returned, in characters.

    Returns:
        The line.
    """
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Utf8JSONResponse(JSONResponse):
    """JSON that names its encoding (``charset=utf-8``), as the explorer's answers always have."""

    media_type = "application/json; charset=utf-8"


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is a route of the OpenAI-compatible API (:mod:`qkv.serve.openai_api`), whose
    errors are in OpenAI's shape: :data:`OPENAI_PATHS` and ``/v1/models/{id}``."""
    return path in OPENAI_PATHS or path.startswith("/v1/models/")


def openai_error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: Any = None
) -> JSONResponse:
    """An error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, its message
    one line; ``type`` is ``server_error`` for a 5xx status, else ``invalid_request_error``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    error = {"message": one_line(message), "type": kind, "param": param, "code": code}
    return Utf8JSONResponse({"error": error}, status_code=status, headers=headers)


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, *, path: str | None = None
) -> JSONResponse:
    """The server's answer to an error: ``{"error": "<one line>"}`` (see :func:`one_line`) as UTF-8 JSON.

    Args:
        status: the HTTP status.
        message: what went wrong.
        headers: headers to send with it (e.g. ``Retry-After``), or None.
        path: the request's path, when known: on an OpenAI route (:func:`is_openai_path`) the error
            is in OpenAI's shape (:func:`openai_error_response`).

    Returns:
        The JSON response.
    """
    if path is not None and is_openai_path(path):
        return openai_error_response(status, message, headers=headers)
    return Utf8JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


def _validation_message(errors: list[Any]) -> tuple[int, str]:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return 400, f"the body is not valid JSON ({reason})" if reason else "the body is not valid JSON"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return 422, f"{where}: {first.get('msg', 'invalid')}{more}"


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as one line of JSON."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.message, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = list(err.errors())
        content_type = request.headers.get("content-type", "")
        if errors and tuple(errors[0].get("loc", ())) == ("body",) and content_type and not _is_json(content_type):
            # a body sent as a form (curl -d without -H) is never read as JSON
            return error_response(
                415, f"send the body as JSON with Content-Type: application/json (got {content_type[:60]!r})"
            )
        status, message = _validation_message(errors)
        return error_response(status, message)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        path = request.url.path[:100]
        headers = dict(err.headers or {})
        if err.status_code == 404:
            message = f"no such page: {path!r}"
        elif err.status_code == 405:
            message = f"{request.method[:20]} is not allowed on {path}; use {headers.get('Allow', 'another method')}"
        else:
            message = str(err.detail)
        return error_response(err.status_code, message, headers)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_name(host: str) -> str:
    """A Host header's name, lower case, without its port (``[::1]:8000`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    """ASGI middleware that checks a request before the application sees it, and answers a fault of
    the application as a 500 that is logged once.

    * a ``Host`` not in ``allowed_hosts`` (when given): 421, so that a web page whose name was
      pointed at this machine (DNS rebinding) cannot read the server's answers;
    * a ``POST`` to one of ``json_paths`` without ``Content-Type: application/json``: 415 (a
      cross-site form can send ``text/plain`` or a form, never JSON, without the server's consent);
    * a body over ``max_bytes``: 413, from its Content-Length at once or as soon as the bytes read
      pass the limit;
    * every answer gets :data:`SECURITY_HEADERS`.

    A refused request is answered before its body is read; uvicorn then reads the rest of the body
    and drops it (held to the body timeout of :mod:`qkv.serve.connections`) rather than closing the
    connection on unread bytes, which a client still sending would see as a reset.
    ``on_client_gone()`` is called for a request whose client went before its body was read.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        allowed_hosts: Collection[str] | None = None,
        json_paths: Collection[str] = (),
        on_client_gone: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.on_client_gone = on_client_gone
        self.max_bytes = max_bytes
        self.allowed_hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.json_paths = set(json_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await self._refuse(scope, receive, send_with_headers, *refusal)
            return
        body, more = b"", True
        while more:  # read the whole body first, bounded (a JSON body is parsed whole anyway)
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing was started for it
                if self.on_client_gone is not None:
                    self.on_client_gone()
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                too_large = f"the body has more than {self.max_bytes} bytes; the limit is {self.max_bytes}"
                await self._refuse(scope, receive, send_with_headers, 413, too_large)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as Starlette expects

        try:
            await self.app(scope, replay, send_with_headers)
        except Exception as err:  # answered here, so that the server does not log it a second time
            method, path = scope.get("method", "?"), str(scope.get("path", ""))[:100]
            logger.error("error while serving %s %s", method, path, exc_info=err)
            if not started:
                answer = error_response(500, "internal error; see the server log", path=scope.get("path"))
                await answer(scope, replay, send_with_headers)

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """The status and message a request is refused with before its body is read, or None."""
        headers = dict(scope.get("headers", []))
        host = headers.get(b"host")
        if self.allowed_hosts is not None and "*" not in self.allowed_hosts and host is not None:
            shown = host.decode("latin-1")
            if host_name(shown) not in self.allowed_hosts:
                names = ", ".join(sorted(self.allowed_hosts))
                return 421, (
                    f"Host {shown[:80]!r} is not a name of this server (it answers to {names}); "
                    f"start it with --allow-host {host_name(shown)[:80]} to accept that name"
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return 413, f"the body has {int(length)} bytes; the limit is {self.max_bytes}"
        if scope.get("method") == "POST" and scope.get("path") in self.json_paths:
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not content_type:
                return (
                    415,
                    "send the body as JSON with Content-Type: application/json (the request has no Content-Type)",
                )
            if not _is_json(content_type):
                return 415, f"send the body as JSON with Content-Type: application/json (got {content_type[:60]!r})"
        return None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        """Answer ``status`` at once, the body unread: the server reads what is left of it and drops
        it (the connection stays open for that, held to the body timeout), so that a client still
        sending reads the answer instead of a reset."""
        await error_response(status, message, path=scope.get("path"))(scope, receive, send)


def parse_json(body: bytes) -> object:
    """A body as JSON, or :class:`ApiError` 400 in one line."""
    try:
        return json.loads(body.decode("utf-8"))
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise ApiError(400, f"the body is not valid JSON ({one_line(err)})") from None
