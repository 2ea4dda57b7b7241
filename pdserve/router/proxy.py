"""The P/D router's HTTP app: `build_app(RouterConfig)`.

Routes: POST /v1/completions and /v1/chat/completions (split into a prefill and a decode leg by the
Orchestrator, or sent whole to one instance in colocated mode), GET /health (200 only when every backend
answers its /health with 200), GET /v1/models (from the first decode, or colocated, instance).
The router speaks HTTP only: it imports neither engine nor model nor torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.credentials import Credentials
from pdserve.kv.capability import KVAuth
from pdserve.openai_request import CHAT_PATH, COMPLETIONS_PATH, parse_request
from pdserve.router.call import Call
from pdserve.router.health import HealthMonitor
from pdserve.router.orchestrate import Orchestrator
from pdserve.router.policy import MODES, POLICIES, Pool
from pdserve.router.upstream import LegError, get_json, make_session
from pdserve.web import (
    DEFAULT_MAX_BODY_BYTES,
    REQUEST_ID_HEADER,
    ClientDisconnected,
    client_request_id,
    error_response,
    json_content_type_error,
    protect,
)

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    mode: str  # "pull" | "push" | "colocated"
    prefill_urls: tuple[str, ...] = ()  # base URLs of prefill instances (pull, push)
    decode_urls: tuple[str, ...] = ()  # base URLs of decode instances (pull, push)
    instance_urls: tuple[str, ...] = ()  # base URLs of `--kv-role both` instances (colocated)
    colocate_below: int | None = None  # pull/push: prompts estimated below this many tokens go to D alone
    policy: str = "least-loaded"  # or "round-robin"
    connect_timeout_s: float = 10.0  # to open a connection to a backend
    health_timeout_s: float = 5.0  # for each backend's /health and P's /kv_transfer/info
    health_interval_s: float = 2.0  # every backend's /health is polled this often (router/health.py)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies are refused with 413
    api_key: str | None = field(default=None, repr=False)  # clients must send it (credentials.py)
    # the deployment's internal credential: the router sends it to every instance instead of api_key
    internal_api_key: str | None = field(default=None, repr=False)
    kv_auth_secret: bytes | None = field(default=None, repr=False)  # signs push capabilities (auth.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not self.health_interval_s > 0 or not self.health_timeout_s > 0:
            raise ValueError("--health-interval-s and --health-timeout-s must be > 0")
        Credentials(self.api_key, self.internal_api_key)  # refuses an empty key, or one key in both roles
        if self.kv_auth_secret is not None and len(self.kv_auth_secret) < 16:
            raise ValueError("the KV auth secret must be at least 16 bytes")
        if self.mode == "colocated":
            if not self.instance_urls:
                raise ValueError("colocated mode needs at least one --instance URL")
            if self.prefill_urls or self.decode_urls:
                raise ValueError("colocated mode takes --instance URLs, not --prefill/--decode")
            if self.colocate_below is not None:
                raise ValueError("--colocate-below applies to pull and push modes only")
        else:
            if not self.prefill_urls or not self.decode_urls:
                raise ValueError(f"{self.mode} mode needs at least one --prefill and one --decode URL")
            if self.instance_urls:
                raise ValueError(f"--instance is for colocated mode; {self.mode} mode takes --prefill and --decode")
            if self.colocate_below is not None and self.colocate_below < 1:
                raise ValueError(f"--colocate-below must be >= 1 token, got {self.colocate_below}")
        for url in self.prefill_urls + self.decode_urls + self.instance_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL {url!r} must start with http:// or https://")

    @property
    def credentials(self) -> Credentials:
        return Credentials(self.api_key, self.internal_api_key)

    @property
    def backend_urls(self) -> list[tuple[str, str]]:
        """(leg name, URL) of every backend, as errors name them."""
        if self.mode == "colocated":
            return [("instance", url) for url in self.instance_urls]
        return [("prefill", url) for url in self.prefill_urls] + [("decode", url) for url in self.decode_urls]


def build_app(config: RouterConfig) -> FastAPI:
    colocated = config.mode == "colocated"
    prefill = None if colocated else Pool("prefill", list(config.prefill_urls), config.policy)
    decode = (
        Pool("instance", list(config.instance_urls), config.policy)
        if colocated
        else Pool("decode", list(config.decode_urls), config.policy)
    )
    holder: dict[str, Orchestrator] = {}  # the session needs a running loop: made in the lifespan

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        session = make_session(config.connect_timeout_s, config.credentials.upstream_key)
        holder["orchestrator"] = Orchestrator(
            config.mode,
            prefill,
            decode,
            session,
            config.health_timeout_s,
            config.colocate_below,
            KVAuth(config.kv_auth_secret),
        )
        pools = [pool for pool in (prefill, decode) if pool is not None]
        monitor = HealthMonitor(
            pools,
            session,
            config.health_interval_s,
            config.health_timeout_s,
            holder["orchestrator"].prefill_info.forget,
        )
        holder["orchestrator"].monitor = monitor
        monitor.start()  # stopped below, before the session closes
        try:
            yield
        finally:
            await monitor.stop()
            await session.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    protect(app, config.credentials, config.max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    async def relay(path: str, request: Request) -> Response:
        orchestrator = holder["orchestrator"]
        started = time.perf_counter()
        wrong_type = json_content_type_error(request.headers.get("content-type"))
        if wrong_type is not None:  # the instances would refuse it: see web.py
            return error_response(400, wrong_type)
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than json can parse
            return error_response(400, f"invalid request: body is not JSON: {type(e).__name__}: {e}")
        if not isinstance(body, dict):
            return error_response(400, "invalid request: body must be a JSON object")
        try:  # what every instance would refuse is refused here, before a prefill leg spends any work on it
            parsed = parse_request(path, body)
        except ValueError as e:
            log.info("POST %s refused with 400: %s", path, e)
            return error_response(400, str(e))
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex
        call = Call(path, body, request_id, request, parsed.stream, parsed.requested_max_tokens)
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
                config.mode,
                "whole" if call.is_whole else "split",
                call.prefill_url,
                "instance" if colocated else "decode",
                call.decode_url,
                status,
                orchestrator.num_whole,
                "first_byte" if call.is_stream and status == 200 else "latency",
                time.perf_counter() - started,
            )

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await relay(COMPLETIONS_PATH, request)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await relay(CHAT_PATH, request)

    @app.get("/health")
    async def health() -> Response:
        session = holder["orchestrator"].session
        legs = config.backend_urls
        results = await asyncio.gather(
            *(get_json(session, leg, url, "/health", config.health_timeout_s) for leg, url in legs),
            return_exceptions=True,
        )
        failures = [str(r) for r in results if isinstance(r, BaseException)]
        if failures:
            return error_response(503, "unhealthy backends: " + "; ".join(failures))
        if colocated:
            return JSONResponse({"status": "ok", "instances": list(config.instance_urls)})
        return JSONResponse({"status": "ok", "prefill": list(config.prefill_urls), "decode": list(config.decode_urls)})

    @app.get("/v1/models")
    async def models() -> Response:
        url = decode.backends[0].url
        try:
            session = holder["orchestrator"].session
            answer = await get_json(session, decode.role, url, "/v1/models", config.health_timeout_s)
        except LegError as e:
            return JSONResponse(e.body, status_code=e.status)
        return JSONResponse(answer)

    return app
