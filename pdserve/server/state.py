"""What the routes of one instance share (ServerState) and its admission control (Limits).

Lives apart from the routes (routes.py) because it is the instance's state machine: the engine-start thread's
body and outcome, readiness, the names served, and the count of requests in flight that admission control
reads. build_app's lifespan starts the engine-start thread (start_engine) and joins it after engine.shutdown().
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.config import ConfigError
from pdserve.engine.client import EngineClient, EngineInfo
from pdserve.http_timeline import EdgeTimelines
from pdserve.kv.capability import KVAuth
from pdserve.server import metrics
from pdserve.server.protocol import ApiError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 from admission control asks the client to wait


@dataclass(frozen=True)
class Limits:
    """Admission control of one instance."""

    max_inflight_requests: int = 1024  # requests held at once (0 = no limit); past it: 503 + Retry-After
    max_queue_wait_s: float | None = None  # still queued after this long: aborted, 503 (None = no deadline)

    def __post_init__(self) -> None:
        if self.max_inflight_requests < 0:
            raise ValueError(f"max_inflight_requests must be >= 0, got {self.max_inflight_requests}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")


def check_capacity(info: EngineInfo) -> None:
    """Refuse to serve with a KV cache smaller than max_model_len tokens: the API accepts requests of up to
    max_model_len tokens, and such a request would need more blocks than there are."""
    num_tokens = info.num_blocks * info.block_size
    if num_tokens < info.max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_tokens} tokens ({info.num_blocks} blocks of {info.block_size}), fewer than "
            f"max_model_len {info.max_model_len}: raise --num-gpu-blocks or --kv-cache-memory-gib, or lower "
            "--max-model-len"
        )


class ServerState:
    """What the routes share: the engine, its start thread, the names it is served under, in-flight ids."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str] | None,
        on_start_failure: Callable[[BaseException], None],
        limits: Limits,
        kv_auth: KVAuth,
    ) -> None:
        self.engine = engine
        self.kv_auth = kv_auth  # checks capabilities on kv_transfer_params (event loop only)
        self.limits = limits
        self.epoch = uuid.uuid4().hex  # this process's identity: a router seeing another one knows it restarted
        self.num_inflight = 0  # requests admitted and not closed yet (event loop only)
        self.served_model_names = served_model_names  # None: the model's own name
        self.registry = metrics.make_registry(engine.stats)  # /metrics
        self.on_start_failure = on_start_failure
        self.start_error: BaseException | None = None
        self.start_thread: threading.Thread | None = None
        # a text prompt longer than this many characters has more than max_model_len tokens (prepare.py); set
        # once the engine started, None: no bound for this tokenizer (or no tokenizer)
        self.max_prompt_chars: int | None = None
        self.edge = EdgeTimelines("instance")  # each request's HTTP-edge events, merged into GET /timeline

    @property
    def model_names(self) -> list[str]:
        return self.served_model_names or [self.engine.info.model_name]

    def start_engine(self) -> None:
        """Body of the engine-start thread."""
        try:
            self.engine.start()
            info = self.engine.info
            check_capacity(info)
            tokenizer = self.engine.tokenizer
            per_token = tokenizer.max_chars_per_token if tokenizer is not None else None
            self.max_prompt_chars = None if per_token is None else per_token * info.max_model_len
            if tokenizer is not None and per_token is None:
                log.info("this tokenizer can fold any number of characters into a token: no prompt length bound")
            log.info("engine ready: model %s, max_model_len %d", info.model_name, info.max_model_len)
        except BaseException as e:
            self.start_error = e
            log.exception("engine failed to start")
            self.on_start_failure(e)

    def check_ready(self) -> None:
        if self.start_error is not None:
            raise ApiError(503, f"engine failed to start: {self.start_error}")
        if not self.engine.is_ready:
            if self.engine.error:  # the engine loop died after it was ready
                raise ApiError(503, f"engine failed: {self.engine.error}")
            raise ApiError(503, "engine is loading the model; retry when /health answers 200")

    def resolve_model(self, requested: str | None) -> str:
        names = self.model_names
        if requested is not None and requested not in names:
            raise ApiError(404, f"the model `{requested}` does not exist; this server serves {names}")
        return requested or names[0]

    def release(self) -> None:
        self.num_inflight -= 1

    def admit(self) -> None:
        """Count one more request in flight, or refuse it with 503 when the instance is full."""
        limit = self.limits.max_inflight_requests
        if limit and self.num_inflight >= limit:
            raise ApiError(503, f"server busy: {self.num_inflight} requests in flight (limit {limit}); retry later")
        self.num_inflight += 1

    @staticmethod
    def new_request_id() -> str:
        """The engine's id for a new request: always the server's own (a client's X-Request-Id is logged and
        echoed, never a key: a client retry must not collide with its first attempt's pinned KV)."""
        return f"req-{uuid.uuid4().hex}"
