"""Every error of the server as JSON ``{"error": "<one line>"}`` with its status, and the middleware
that bounds request bodies and adds the security headers to every answer.

* a client's mistake the routes find: :class:`ApiError` (status, message);
* a request the schema refuses: 422, naming the field (malformed JSON: 400; a body not sent as
  ``application/json``: 415);
* an unknown path: 404; a method the path does not take: 405 with ``Allow``;
* a body over the limit: 413, before it is read further;
* anything else: 500 ``internal error; see the server log`` (the traceback goes to the log only).
"""

from __future__ import annotations

import json
import logging
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
    """A client error the routes find: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def one_line(message: object, limit: int = 300) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Utf8JSONResponse(JSONResponse):
    """JSON that names its encoding (``charset=utf-8``), as the explorer's answers always have."""

    media_type = "application/json; charset=utf-8"


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
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
        return error_response(err.status, err.message)

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

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        logger.error("error while serving %s %s", request.method, request.url.path[:100], exc_info=err)
        return error_response(500, "internal error; see the server log")


class BoundedBodies:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (from its Content-Length at once,
    or as soon as the bytes read pass the limit); every answer gets :data:`SECURITY_HEADERS`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send_with_headers, f"{int(length)} bytes")
            return
        body, more = b"", True
        while more:  # read the whole body first, bounded (a JSON body is parsed whole anyway)
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._too_large(scope, receive, send_with_headers, f"more than {self.max_bytes} bytes")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as Starlette expects

        await self.app(scope, replay, send_with_headers)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        response = error_response(413, f"the body has {size}; the limit is {self.max_bytes}")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def parse_json(body: bytes) -> object:
    """A body as JSON, or :class:`ApiError` 400 in one line."""
    try:
        return json.loads(body.decode("utf-8"))
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise ApiError(400, f"the body is not valid JSON ({one_line(err)})") from None
