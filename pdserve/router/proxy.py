"""The P/D router's HTTP app: `build_app(RouterConfig)`; its routes are module-level handlers reading what they
share from `app.state.router` (a RouterState).

Routes: POST /v1/completions and /v1/chat/completions (split into a prefill and a decode leg by the
Orchestrator, or sent whole to one instance in colocated mode), GET /health (200 only when every backend
answers its /health with 200), GET /v1/models (from the first decode, or colocated, instance), GET /metrics
(the router's own counters: router/metrics.py).

With `--routing kv-aware` the lifespan also follows every instance's /kv_events (router/kv_stream.py) and loads
the tokenizer for text prompts in the background (router/prompt_tokens.py). Shutdown order: the tokenizer
task, the event streams and the health monitor stop, then the HTTP session closes.
The router speaks HTTP only: it imports neither engine nor model nor torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.http_timeline import EdgeTimelines, events_of, mark
from pdserve.kv.capability import KVAuth
from pdserve.openai_request import CHAT_PATH, COMPLETIONS_PATH, parse_request
from pdserve.router import prompt_tokens
from pdserve.router.call import Call
from pdserve.router.config import RouterConfig
from pdserve.router.health import HealthMonitor
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_route import KVRoute
from pdserve.router.kv_stream import KVEventStreams
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrate import Orchestrator
from pdserve.router.policy import Pool
from pdserve.router.upstream import LegError, get_json, make_session
from pdserve.web import (
    REQUEST_ID_HEADER,
    ClientDisconnected,
    client_request_id,
    error_response,
    install_http_error_handler,
    json_content_type_error,
    parse_json,
    protect,
)

log = logging.getLogger("pdserve.router")

routes = APIRouter()


class RouterState:
    """What the routes share: the configuration, the pools, and (from the lifespan on, since its HTTP session
    needs a running loop) the orchestrator."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.colocated = config.mode == "colocated"
        self.prefill = None if self.colocated else Pool("prefill", list(config.prefill_urls), config.policy)
        self.decode = (
            Pool("instance", list(config.instance_urls), config.policy)
            if self.colocated
            else Pool("decode", list(config.decode_urls), config.policy)
        )
        self.is_kv_aware = config.policy == "kv-aware"
        urls = [b.url for pool in (self.prefill, self.decode) if pool is not None for b in pool.backends]
        self.kv_index = KVIndex(urls if self.is_kv_aware else [], config.kv_index_max_keys)  # URL -> prefix index
        self.metrics = RouterMetrics()  # the router's own /metrics
        self.edge = EdgeTimelines("router")  # each call's edge events (GET /timeline)
        self._orchestrator: Orchestrator | None = None

    def attach(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    @property
    def orchestrator(self) -> Orchestrator:
        assert self._orchestrator is not None, "the app's lifespan has not started"
        return self._orchestrator


def build_app(config: RouterConfig) -> FastAPI:
    app = FastAPI(title="pdserve router", lifespan=_lifespan)
    app.state.router = RouterState(config)
    protect(app, config.credentials, config.max_body_bytes)
    install_http_error_handler(app)
    app.include_router(routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: RouterState = app.state.router
    config = state.config
    session = make_session(config.connect_timeout_s, config.credentials.upstream_key)
    orchestrator = Orchestrator(
        config.mode,
        state.prefill,
        state.decode,
        session,
        config.health_timeout_s,
        config.colocate_below,
        KVAuth(config.kv_auth_secret),
        KVRoute(state.kv_index, config.kv_weights, state.metrics),
    )
    pools = [pool for pool in (state.prefill, state.decode) if pool is not None]
    monitor = HealthMonitor(
        pools, session, config.health_interval_s, config.health_timeout_s, orchestrator.prefill_info.forget
    )
    orchestrator.monitor = monitor
    state.attach(orchestrator)
    streams = KVEventStreams(state.kv_index, session, state.metrics)  # no instances unless kv-aware
    tokenizer_task: asyncio.Task[None] | None = None
    if state.is_kv_aware:

        async def load_tokenizer() -> None:
            try:
                orchestrator.prompts = await prompt_tokens.load(
                    config.tokenizer, state.decode.backends[0].url, session, config.health_timeout_s,
                    config.health_interval_s,
                )  # fmt: skip
            except Exception:  # said now, not at shutdown: text prompts stay routed by load
                log.exception("loading the router's tokenizer failed: text prompts are routed by load")

        tokenizer_task = asyncio.create_task(load_tokenizer(), name="router-tokenizer")
    monitor.start()  # these three are stopped below, before the session closes
    streams.start()
    try:
        yield
    finally:
        if tokenizer_task is not None:  # never raises here: the streams, monitor and session must still stop
            tokenizer_task.cancel()
            try:
                await tokenizer_task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("the router's tokenizer task failed")
        await streams.stop()
        await monitor.stop()
        await session.close()


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


async def _relay(path: str, request: Request) -> Response:
    state = _state(request)
    orchestrator = state.orchestrator
    started = time.perf_counter()
    wrong_type = json_content_type_error(request.headers.get("content-type"))
    if wrong_type is not None:  # the instances would refuse it: see web.py
        return error_response(400, wrong_type)
    try:
        raw = await request.body()
        mark(request, "body_read")
        body = parse_json(raw)
        mark(request, "body_parsed")
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than json can parse
        return error_response(400, f"invalid request: body is not JSON: {type(e).__name__}: {e}")
    if not isinstance(body, dict):
        return error_response(400, "invalid request: body must be a JSON object")
    try:  # what every instance would refuse is refused here, before a prefill leg spends any work on it
        parsed = parse_request(path, body)
    except ValueError as e:
        log.info("POST %s refused with 400: %s", path, e)
        return error_response(400, str(e))
    mark(request, "body_validated")
    client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    request_id = client_id or uuid.uuid4().hex
    state.edge.add(request_id, client_id, events_of(request))
    call = Call(path, body, request_id, request, parsed.stream, parsed.requested_max_tokens, parsed=parsed)
    status = 200
    try:
        return await orchestrator.handle(call)
    except LegError as e:
        status = e.status
        headers = {**call.headers, **({"Retry-After": e.retry_after} if e.retry_after else {})}
        return JSONResponse(e.body, status_code=e.status, headers=headers)
    except ClientDisconnected:
        status = 499
        return Response(status_code=499)
    finally:
        log.info(
            "request %s mode=%s route=%s prefill=%s %s=%s status=%d whole_total=%d %s=%.3fs",
            call.request_id,
            state.config.mode,
            "whole" if call.is_whole else "split",
            call.prefill_url,
            "instance" if state.colocated else "decode",
            call.decode_url,
            status,
            orchestrator.num_whole,
            "first_byte" if call.is_stream and status == 200 else "latency",
            time.perf_counter() - started,
        )


@routes.post(COMPLETIONS_PATH)
async def completions(request: Request) -> Response:
    return await _relay(COMPLETIONS_PATH, request)


@routes.post(CHAT_PATH)
async def chat_completions(request: Request) -> Response:
    return await _relay(CHAT_PATH, request)


@routes.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    config = state.config
    results = await asyncio.gather(
        *(
            get_json(state.orchestrator.session, leg, url, "/health", config.health_timeout_s)
            for leg, url in config.backend_urls
        ),
        return_exceptions=True,
    )
    failures = [str(r) for r in results if isinstance(r, BaseException)]
    if failures:
        return error_response(503, "unhealthy backends: " + "; ".join(failures))
    if state.colocated:
        return JSONResponse({"status": "ok", "instances": list(config.instance_urls)})
    return JSONResponse({"status": "ok", "prefill": list(config.prefill_urls), "decode": list(config.decode_urls)})


@routes.get("/timeline")
async def timeline(request: Request) -> Response:
    """The edge events of the router's recent calls (http_timeline.py), in the instances' /timeline shape."""
    return JSONResponse(_state(request).edge.snapshot())


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    body = state.metrics.render(state.kv_index if state.is_kv_aware else None)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    url = state.decode.backends[0].url
    try:
        session = state.orchestrator.session
        answer = await get_json(session, state.decode.role, url, "/v1/models", state.config.health_timeout_s)
    except LegError as e:
        return JSONResponse(e.body, status_code=e.status)
    return JSONResponse(answer)
