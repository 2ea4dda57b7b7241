"""The routes of one engine instance, as module-level handlers on one APIRouter (the app: api.py). Each reads
what the instance shares from `request.app.state.pdserve` (a ServerState, state.py).

POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models, /health (200 only when
the engine is ready), /metrics (Prometheus text), /kv_transfer/info, POST /kv_transfer/release, /timeline,
/kv_events (a long poll over the prefix cache's events: kv_events.py).
Who may call which: credentials.py (applied by web.protect).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from pdserve import prompt_pack
from pdserve.auth import AuthError
from pdserve.engine.client import ReleaseRequest
from pdserve.http_timeline import mark
from pdserve.kv.decode import decode
from pdserve.openai_request import ChatCompletionRequest, CompletionRequest
from pdserve.server import kv_events, metrics
from pdserve.server.answer import answer
from pdserve.server.fast_json import FastJSONRoute
from pdserve.server.prepare import DEFAULT_COMPLETION_MAX_TOKENS, chat_prompt_ids, completion_prompt_ids
from pdserve.server.protocol import ApiError, KVReleaseRequest, ModelCard, ModelList
from pdserve.server.refusal import EdgeRefusal
from pdserve.server.state import ServerState
from pdserve.web import error_response, is_internal_caller

routes = APIRouter(route_class=FastJSONRoute)  # bodies parsed by pydantic-core (fast_json.py)


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.pdserve
    return state


@routes.get("/health")
async def health(request: Request) -> Response:
    state = state_of(request)
    try:
        state.check_ready()
    except ApiError as e:  # polled while loading: answered without a log line
        return error_response(e.status, e.message)
    return JSONResponse({"status": "ok", "epoch": state.epoch, prompt_pack.HEALTH_KEY: prompt_pack.VERSION})


@routes.get("/v1/models")
async def models(request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    if not state.served_model_names:
        state.check_ready()  # the model's own name is known once it is loaded
    max_len = engine.info.max_model_len if engine.is_ready else None
    cards = [ModelCard(id=name, root=engine.model_path, max_model_len=max_len) for name in state.model_names]
    return JSONResponse(ModelList(data=cards).model_dump())


@routes.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    body = await run_in_threadpool(metrics.render, state_of(request).registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@routes.get("/kv_transfer/info")
async def kv_transfer_info(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    return JSONResponse(state.engine.info.kv_transfer_info)


@routes.post("/kv_transfer/release")
async def kv_transfer_release(body: KVReleaseRequest, request: Request) -> Response:
    """Free P's pin for one request at once (idempotent); 404 when this instance does not know it. The caller
    shows the internal credential or the request's capability (with a secret), never just its id."""
    state = state_of(request)
    state.check_ready()
    engine = state.engine
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
            f"request_id {body.request_id!r}" if body.request_id is not None else f"transfer_id {body.transfer_id!r}"
        )
        raise ApiError(404, f"no pinned or running request with {which} on this instance")
    return JSONResponse({"released": True})


@routes.get("/timeline")
async def timeline(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    return JSONResponse(state.edge.merged(state.engine.timelines()))


@routes.get("/kv_events")
async def kv_cache_events(request: Request) -> Response:
    """Which full blocks entered and left this instance's prefix cache since `after` (or a snapshot)."""
    state = state_of(request)
    state.check_ready()
    query = kv_events.parse_query(request.query_params)
    engine = state.engine
    body = await kv_events.poll(state.epoch, engine.info, engine.kv_events, query)
    return Response(body, media_type="application/json")


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    mark(request, "body_validated")
    state = state_of(request)
    with EdgeRefusal(state, body.kv_transfer_params) as edge:  # refused before the engine has it: P frees it
        state.check_ready()
        model = state.resolve_model(body.model)
        engine = state.engine
        if not isinstance(body.prompt, str):  # token ids (a list, or the router's packed array): no worker thread
            prompt_ids = completion_prompt_ids(body, None)
        else:
            prompt_ids = await run_in_threadpool(  # tokenizing: off the event loop
                completion_prompt_ids, body, engine.tokenizer, state.max_prompt_chars, engine.info.max_model_len
            )
        return await answer(state, "completion", body, model, prompt_ids, DEFAULT_COMPLETION_MAX_TOKENS, request, edge)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    mark(request, "body_validated")
    state = state_of(request)
    with EdgeRefusal(state, body.kv_transfer_params) as edge:
        state.check_ready()
        model = state.resolve_model(body.model)
        engine = state.engine
        prompt_ids = await run_in_threadpool(  # templating: off the loop
            chat_prompt_ids, body, engine.tokenizer, state.max_prompt_chars, engine.info.max_model_len
        )
        return await answer(state, "chat", body, model, prompt_ids, None, request, edge)
