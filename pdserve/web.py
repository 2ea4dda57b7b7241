"""What the instance server and the router share over HTTP: the request-id header, the error shape (Starlette's
own errors in it too), noticing that a client went away, and the request-body size limit (who may call which
route: credentials.py).

Light on purpose (starlette and pydantic only): the router imports this and nothing of `pdserve.server`, and
neither imports the engine or torch through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.credentials import INTERNAL_CALLER, Credentials, RouteRole
from pdserve.http_timeline import StampReceived

T = TypeVar("T")

REQUEST_ID_HEADER = "X-Request-Id"  # a client's id for its request: logged and echoed, never an engine key
MAX_REQUEST_ID_CHARS = 128  # longer client ids are cut (logs and echo only)
DEFAULT_MAX_BODY_BYTES = 32 * 2**20  # a request body larger than this is refused with 413
# uvicorn's HTTP/1.1 parser (h11) holds at most this much of a request head that has not fully arrived; a longer
# head gets 400 and a closed connection. Its default (16 KiB) made a 60 KB header pass or fail depending on
# whether the head arrived in one read (CI saw a connection reset); 64 KiB takes such heads in any split.
MAX_REQUEST_HEAD_BYTES = 64 * 1024

ERROR_TYPES = {  # HTTP status -> OpenAI error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",  # an unsigned, forged, expired or replayed kv_capability
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

    @classmethod
    def of(cls, status: int, message: str) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), code=status))


def error_body(status: int, message: str) -> dict:
    """The error shape as a plain dict (for JSON and SSE)."""
    return ErrorResponse.of(status, message).model_dump()


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def json_content_type_error(content_type: str | None) -> str | None:
    """Why a body sent with this Content-Type is not read as JSON, or None when it is. FastAPI's rule, which
    the router follows too: application/json or application/*+json, and the header is required (curl -d
    without -H sends a form)."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return None
    return f"invalid request: Content-Type must be application/json, got {content_type or 'none'!r}"


def client_request_id(header: str | None) -> str | None:
    """The client's X-Request-Id as we log and echo it: printable ASCII, at most MAX_REQUEST_ID_CHARS."""
    if not header:
        return None
    cleaned = "".join(c for c in header if c.isascii() and c.isprintable())
    return cleaned[:MAX_REQUEST_ID_CHARS] or None


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


async def until_disconnect(request: Request) -> None:
    """Return when the client disconnects. Call only after the request body has been read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t


class RoleAuth:
    """ASGI middleware: answers 401 unless the request presents a credential its route's role accepts (the
    table in the module docstring); comparisons take the same time whatever was sent."""

    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        if not credentials.is_enabled:
            raise ValueError("no key set: nothing to check")
        self.app = app
        self.credentials = credentials
        self._client = f"Bearer {credentials.client_key}".encode() if credentials.client_key else None
        self._internal = f"Bearer {credentials.internal_key}".encode() if credentials.internal_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        is_client = self._client is not None and hmac.compare_digest(given, self._client)
        is_internal = self._internal is not None and hmac.compare_digest(given, self._internal)
        if is_internal:
            scope.setdefault("state", {})[INTERNAL_CALLER] = True
        role = self.credentials.route_role(scope.get("path", ""))
        if role is RouteRole.OPEN:
            allowed = True
        elif role is RouteRole.CLIENT:
            allowed = self._client is None or is_client or is_internal
        elif self._internal is not None:
            allowed = is_internal
        else:
            allowed = self._client is None or is_client
        if allowed:
            await self.app(scope, receive, send)
            return
        if role is RouteRole.INTERNAL and self._internal is not None:
            message = "this route needs the deployment's internal API key (the client key does not open it)"
        else:
            message = "missing or wrong API key (send Authorization: Bearer <key>)"
        await error_response(401, message)(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail))


def install_http_error_handler(app: Starlette) -> None:
    """Starlette's own HTTP errors (404 for an unknown path, 405 for a wrong method) in the OpenAI error shape."""
    app.add_exception_handler(StarletteHTTPException, _http_error)


def is_internal_caller(request: Request) -> bool:
    """Whether this request presented the internal credential (RoleAuth marked it)."""
    return bool(request.scope.get("state", {}).get(INTERNAL_CALLER, False))


def protect(app: Starlette, credentials: Credentials | None, max_body_bytes: int) -> None:
    """Add the shared middleware to a FastAPI/Starlette app: body-size limit, then the keys if any is set, and
    outermost the stamp of each request's arrival (http_timeline.py)."""
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if credentials is not None and credentials.is_enabled:
        app.add_middleware(RoleAuth, credentials=credentials)
    app.add_middleware(StampReceived)


class BodySizeLimit:
    """ASGI middleware: a request whose body exceeds `max_bytes` is answered 413 before the app sees it.
    Checked against Content-Length when given; otherwise the body is read (up to the limit) and replayed."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"request body larger than {self.max_bytes} bytes")
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops reading at Content-Length
            return
        chunks: list[bytes] = []
        seen = 0
        while True:  # no Content-Length (chunked): read it all, bounded, then replay it
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def parse_json(body: bytes | str) -> Any:
    """The JSON document `body` as json.loads reads it, through pydantic-core's parser where that reads it too (a
    16k-id prompt in about half the time); what it refuses goes to json.loads: a non-JSON body raises its
    JSONDecodeError, one only json reads (a lone surrogate escape) parses as before. Router and instances."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)
