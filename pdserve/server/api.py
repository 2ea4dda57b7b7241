"""The HTTP app of one engine instance: `build_app(engine)` returns the FastAPI app; its routes are module-level
handlers (routes.py) reading what they share from `app.state.pdserve` (a ServerState, state.py).

Threads: the engine loads its model and runs its step loop off the event loop. The app's lifespan starts
`engine.start()` in a thread named engine-start (so /health answers 503 while the model loads) and calls
`engine.shutdown()` when the server stops, then joins that thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from pdserve.credentials import Credentials
from pdserve.engine.client import EngineClient
from pdserve.kv.capability import KVAuth
from pdserve.openai_request import describe
from pdserve.server.protocol import ApiError
from pdserve.server.refusal import give_back_unparsed
from pdserve.server.routes import routes, state_of
from pdserve.server.state import RETRY_AFTER_S, Limits, ServerState
from pdserve.web import (
    DEFAULT_MAX_BODY_BYTES,
    ClientDisconnected,
    error_response,
    install_http_error_handler,
    json_content_type_error,
    protect,
)

log = logging.getLogger(__name__)


def build_app(
    engine: EngineClient,
    served_model_names: list[str] | None = None,
    on_start_failure: Callable[[BaseException], None] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    credentials: Credentials | None = None,
    limits: Limits | None = None,
    kv_auth: KVAuth | None = None,
) -> FastAPI:
    """The app serving `engine` (an AsyncEngine, not started yet). `on_start_failure` is called from the
    engine-start thread if the model fails to load (the CLI uses it to stop the server). `credentials`: the client
    key and the internal credential (credentials.py; None: every route is open). `kv_auth` checks
    kv_transfer_params' capabilities (None: nothing is checked)."""
    app = FastAPI(title="pdserve", lifespan=_lifespan)
    app.state.pdserve = ServerState(
        engine, served_model_names, on_start_failure or (lambda e: None), limits or Limits(), kv_auth or KVAuth(None)
    )
    protect(app, credentials, max_body_bytes)  # who may call which route (credentials.py)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(ClientDisconnected, _gone)
    install_http_error_handler(app)
    app.include_router(routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.pdserve
    state.start_thread = threading.Thread(target=state.start_engine, name="engine-start", daemon=True)
    state.start_thread.start()
    try:
        yield
    finally:
        await asyncio.to_thread(state.engine.shutdown)
        await asyncio.to_thread(state.start_thread.join, 30)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    log.info("%s %s refused with %d: %s", request.method, request.url.path, exc.status, exc.message)
    retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return error_response(exc.status, exc.message, headers=retry)


async def _invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message = _validation_message(exc, request.headers.get("content-type"))
    log.info("%s %s refused with 400: %s", request.method, request.url.path, message)
    if request.url.path.startswith("/v1/"):  # a decode leg's producer frees its KV now
        give_back_unparsed(state_of(request), exc.body)
    return error_response(400, message)


async def _gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # the client disconnected: nobody reads it


def _validation_message(exc: RequestValidationError, content_type: str | None) -> str:
    wrong_type = json_content_type_error(content_type)
    if wrong_type is not None:  # FastAPI did not parse the body: what pydantic says of the raw bytes is noise
        return wrong_type
    errors = exc.errors()
    if any(err.get("loc") == ("body",) and err.get("type") == "model_attributes_type" for err in errors):
        return "invalid request: body must be a JSON object"
    for err in errors:
        if err.get("type") == "json_invalid":
            where = err.get("loc", ("body", "?"))[-1]
            return f"invalid request: body is not valid JSON ({err.get('ctx', {}).get('error', 'error')} at {where})"
    return describe(errors)
