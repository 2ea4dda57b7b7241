"""The HTTP API of one engine instance: `build_app(engine)` returns the FastAPI app (its shared state: state.py).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models, /health
(200 only when the engine is ready), /metrics (Prometheus text), /kv_transfer/info, /timeline.

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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.auth import AuthError
from pdserve.credentials import Credentials
from pdserve.engine.client import AddRequest, EngineClient, ReleaseRequest
from pdserve.kv.capability import KVAuth
from pdserve.kv.decode import decode
from pdserve.kv.params import KVParamsError, PullSource, RemoteDecode
from pdserve.openai_request import ChatCompletionRequest, CompletionRequest, SamplingFields, describe
from pdserve.server import metrics
from pdserve.server.prepare import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    chat_prompt_ids,
    check_output_fits,
    completion_prompt_ids,
    sampling_params,
)
from pdserve.server.protocol import ApiError, KVReleaseRequest, ModelCard, ModelList
from pdserve.server.refusal import EdgeRefusal, give_back_unparsed
from pdserve.server.render import Kind, Renderer
from pdserve.server.state import RETRY_AFTER_S, Limits, ServerState
from pdserve.server.streams import RequestRun
from pdserve.web import (
    DEFAULT_MAX_BODY_BYTES,
    REQUEST_ID_HEADER,
    ClientDisconnected,
    client_request_id,
    error_response,
    is_internal_caller,
    json_content_type_error,
    protect,
)

log = logging.getLogger(__name__)


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
    state = ServerState(
        engine, served_model_names, on_start_failure or (lambda e: None), limits or Limits(), kv_auth or KVAuth(None)
    )
    registry = metrics.make_registry(engine.stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_thread = threading.Thread(target=state.start_engine, name="engine-start", daemon=True)
        state.start_thread.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            await asyncio.to_thread(state.start_thread.join, 30)

    app = FastAPI(title="pdserve", lifespan=lifespan)
    protect(app, credentials, max_body_bytes)  # who may call which route (credentials.py)
    app.state.pdserve = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        log.info("%s %s refused with %d: %s", request.method, request.url.path, exc.status, exc.message)
        retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return error_response(exc.status, exc.message, headers=retry)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        message = _validation_message(exc, request.headers.get("content-type"))
        log.info("%s %s refused with 400: %s", request.method, request.url.path, message)
        if request.url.path.startswith("/v1/"):  # a decode leg's producer frees its KV now
            give_back_unparsed(state, exc.body)
        return error_response(400, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.get("/health")
    async def health() -> Response:
        try:
            state.check_ready()
        except ApiError as e:  # polled while loading: answered without a log line
            return error_response(e.status, e.message)
        return JSONResponse({"status": "ok", "epoch": state.epoch})

    @app.get("/v1/models")
    async def models() -> Response:
        if not served_model_names:
            state.check_ready()  # the model's own name is known once it is loaded
        max_len = engine.info.max_model_len if engine.is_ready else None
        root = engine.model_path
        cards = [ModelCard(id=name, root=root, max_model_len=max_len) for name in state.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = await run_in_threadpool(metrics.render, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_transfer/info")
    async def kv_transfer_info() -> Response:
        state.check_ready()
        return JSONResponse(engine.info.kv_transfer_info)

    @app.post("/kv_transfer/release")
    async def kv_transfer_release(body: KVReleaseRequest, request: Request) -> Response:
        """Free P's pin for one request at once (idempotent); 404 when this instance does not know it. The caller
        shows the internal credential or the request's capability (with a secret), never just its id."""
        state.check_ready()
        try:
            command = ReleaseRequest(body.request_id, body.transfer_id)
            params = decode(body.kv_transfer_params)
        except ValueError as e:  # KVParamsError too: names the bad key
            raise ApiError(400, str(e)) from None
        if not is_internal_caller(request):
            try:
                state.kv_auth.check_release(body.request_id, body.transfer_id, params, engine.info.kv_transfer_info)
            except AuthError as e:
                raise ApiError(403, str(e)) from e
        if not await engine.release(command):
            which = (
                f"request_id {body.request_id!r}"
                if body.request_id is not None
                else f"transfer_id {body.transfer_id!r}"
            )
            raise ApiError(404, f"no pinned or running request with {which} on this instance")
        return JSONResponse({"released": True})

    @app.get("/timeline")
    async def timeline() -> Response:
        state.check_ready()
        return JSONResponse(engine.timelines())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        with EdgeRefusal(state, body.kv_transfer_params) as edge:  # refused before the engine has it: P frees it
            state.check_ready()
            model = state.resolve_model(body.model)
            prompt_ids = await run_in_threadpool(  # off the event loop
                completion_prompt_ids, body, engine.tokenizer, state.max_prompt_chars, engine.info.max_model_len
            )
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
            return await _answer(state, "completion", body, model, prompt_ids, max_tokens, request, edge)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        with EdgeRefusal(state, body.kv_transfer_params) as edge:
            state.check_ready()
            model = state.resolve_model(body.model)
            prompt_ids = await run_in_threadpool(  # templating: off the loop
                chat_prompt_ids, body, engine.tokenizer, state.max_prompt_chars, engine.info.max_model_len
            )
            return await _answer(state, "chat", body, model, prompt_ids, None, request, edge)

    return app


async def _answer(
    state: ServerState,
    kind: Kind,
    body: SamplingFields,
    model: str,
    prompt_ids: list[int],
    default_max_tokens: int | None,
    request: Request,
    edge: EdgeRefusal,
) -> Response:
    """Run one request on the engine and answer it, streaming or not (refused before the engine has it: `edge`
    gives its transfer coordinates back)."""
    engine = state.engine
    params = sampling_params(body, len(prompt_ids), engine.info.max_model_len, default_max_tokens)
    request_id = state.new_request_id()
    client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    try:
        kv_params = decode(body.kv_transfer_params)  # parsed once, here; typed from now on
    except KVParamsError as e:
        raise ApiError(400, str(e)) from e
    if isinstance(kv_params, RemoteDecode) and kv_params.decode_max_tokens is not None:
        check_output_fits(len(prompt_ids), kv_params.decode_max_tokens, engine.info.max_model_len)
    try:  # before anything is allocated or dialed: coordinates must have been issued for this prompt
        state.kv_auth.check(kv_params, prompt_ids, engine.info.kv_transfer_info)
    except AuthError as e:
        raise ApiError(403, str(e)) from e
    if isinstance(kv_params, PullSource) and kv_params.num_tokens < len(prompt_ids) - 1:
        # D computes the last prompt token itself and receives the KV of all the others
        raise ApiError(
            400,
            f"kv_transfer_params name KV for {kv_params.num_tokens} tokens; a prompt of {len(prompt_ids)} tokens "
            f"needs {len(prompt_ids) - 1} (send the prompt the prefill instance computed)",
        )
    command = AddRequest(request_id, tuple(prompt_ids), params, kv_params, client_id)
    state.admit()
    try:
        run = RequestRun(engine, command, request, state.limits.max_queue_wait_s)
    except BaseException as e:
        state.num_inflight -= 1
        if isinstance(e, ValueError):  # the engine refused the input at once
            raise ApiError(400, str(e)) from e
        raise
    edge.engine_has_it = True  # from here its refusal or abort is the engine's to report to P
    run.on_close = state.release
    renderer = Renderer(kind, request_id, model, prompt_ids, body.return_token_ids, body.include_usage)
    headers = {REQUEST_ID_HEADER: client_id or request_id}
    handed_over = False  # True once a streaming response owns `run` (it closes it)
    try:
        first = await run.first()  # bad input surfaces here, before any byte of the answer is sent
        if body.stream:
            events = renderer.events(run, first)
            handed_over = True
            return StreamingResponse(
                events, media_type="text/event-stream", headers=headers, background=BackgroundTask(run.close)
            )
        out = await run.final()
        if out is not None and out.finish_reason == "abort" and out.released:
            # the router released this prefill (POST /kv_transfer/release: its client or decode leg is gone) and
            # may close this connection at the same moment: a 499 either way, whichever P notices first
            run.status = 499
            return error_response(
                499, f"request {request_id} was released (POST /kv_transfer/release) before its prefill finished"
            )
        if out is None or not out.finished or out.finish_reason in ("error", "abort"):
            run.status = 500
            message = (out.error if out is not None else None) or f"request {request_id} was aborted by the engine"
            return error_response(500, message)
        return JSONResponse(renderer.response(out), headers=headers)
    finally:
        if not handed_over:
            await run.close()
