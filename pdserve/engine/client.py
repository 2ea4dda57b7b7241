"""The engine as its clients (the HTTP server, metrics, tests) see it: a narrow, typed facade.

`EngineClient` is the Protocol the server holds; `AsyncEngine` implements it. The commands that cross from
the event loop to the engine thread are the frozen dataclasses below, and what comes back is RequestOutput
(per request) and EngineStats (a snapshot the engine thread publishes). Importing this module loads no
torch, so the server's request path stays importable without the model stack.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.engine.outputs import RequestOutput
from pdserve.kv.params import KVTransferParams, PullSource, PushSource
from pdserve.prompt_pack import TokenArray
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.kv_events import KVEventLog
    from pdserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class AddRequest:
    """Event loop -> engine thread: start a request."""

    request_id: str  # the server's own id, unique among requests in flight on this instance
    prompt_token_ids: tuple[int, ...] | TokenArray  # the router's packed ids stay their read-only array
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None  # parsed from the request body (P/D legs only)
    client_request_id: str | None = None  # the client's X-Request-Id: logs, echo and /timeline only


@dataclass(frozen=True)
class AbortRequest:
    """Event loop -> engine thread: stop a request (client gone); its blocks are freed."""

    request_id: str


@dataclass(frozen=True)
class ReleaseRequest:
    """Event loop -> engine thread (P): give up the pinned KV of a finished request now (the router's
    POST /kv_transfer/release after D's leg failed); a request still running is aborted. Exactly one of the
    two ids is set. The engine answers through `reply`: True when it knew the request (idempotent: a repeat for
    one it released answers True again), False when unknown (the server's 404)."""

    request_id: str | None  # pull: P's request id (remote_request_id in P's answer)
    transfer_id: str | None  # push: the router's transfer id
    reply: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future, compare=False)

    def __post_init__(self) -> None:
        if (self.request_id is None) == (self.transfer_id is None):
            raise ValueError("give exactly one of request_id and transfer_id")


@dataclass(frozen=True)
class AbortIfQueued:
    """Event loop -> engine thread: the request's queue wait ran out (--max-queue-wait-s); abort it only if it
    never left the waiting queue. The engine answers through `reply`: True when it aborted it (the server's 503),
    False when the request has started (it runs to its end) or already ended."""

    request_id: str
    reply: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future, compare=False)


@dataclass(frozen=True)
class RefuseTransfer:
    """Event loop -> engine thread (D): a request carrying these transfer coordinates was refused before the
    engine had it (the server checked their capability first): their producer frees that KV now instead of at
    its lease (docs/architecture.md, "Release on refusal")."""

    source: PullSource | PushSource


EngineCommand = AddRequest | AbortRequest | ReleaseRequest | AbortIfQueued | RefuseTransfer


@dataclass(frozen=True)
class EngineInfo:
    """What is fixed once the engine has started (read from any thread)."""

    model_name: str  # the loaded model's name (served name unless --served-model-name)
    model_path: str  # what was loaded (path or built-in name), reported as `root` by /v1/models
    max_model_len: int
    vocab_size: int
    num_blocks: int  # KV cache blocks of this instance
    block_size: int  # tokens per KV block
    kv_transfer_info: dict[str, Any]  # GET /kv_transfer/info (engine id, side channel, block size, mode...)
    prefix_caching: bool = True  # full blocks are cached and reused (GET /kv_events reports them)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after each step (and when idle); read by /metrics."""

    num_blocks_total: int
    num_blocks_free: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    kv_sent_bytes: int
    kv_received_bytes: int
    transfers_ok: int
    transfers_failed: int
    transfers_expired: int
    num_engine_steps: int = 0  # LLMEngine.step() calls so far
    transfer_hook_seconds: float = 0.0  # engine-thread seconds spent in the connector hooks so far
    num_step_failures: int = 0  # steps that raised; their requests failed, the loop went on
    kv_checksum_failures: int = 0  # --kv-checksum: recvs whose KV did not match P's sums (failed or recomputed)
    num_requests_started: int = 0  # requests that left the waiting queue here, each once (engine/admissions.py)
    num_prompt_tokens: int = 0  # their prompt tokens
    num_prefix_hit_tokens: int = 0  # of those, tokens this instance's own prefix cache served (received KV is not)
    num_prepared_writes: int = 0  # push P: WRITEs laid out ahead of their prefill's end and not yet posted or freed
    ttft_seconds: list[float] = field(default_factory=list)  # observations drained since the last stats()
    transfer_seconds: list[float] = field(default_factory=list)  # drained since the last stats()
    transfer_descriptors: list[int] = field(default_factory=list)  # per posted READ/WRITE, drained likewise
    transfer_post_seconds: list[float] = field(default_factory=list)  # NIXL's time to accept each, drained
    side_channel_refused: dict[str, int] = field(default_factory=dict)  # since start, by reason (side_admission.py)


class EngineClient(Protocol):
    """What the HTTP server needs of an engine. All methods are called from the event loop thread."""

    @property
    def is_ready(self) -> bool:
        """True once start() finished and while the engine loop is alive."""

    @property
    def error(self) -> str | None:
        """Why the engine loop died, if it did."""

    @property
    def info(self) -> EngineInfo:
        """Fixed facts of the started engine; raises RuntimeError before start()."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for dummy-weight presets: token-id prompts only)."""

    @property
    def model_path(self) -> str:
        """What this engine loads (known before start)."""

    def start(self) -> None:
        """Load the model and start the engine loop (blocking; seconds)."""

    def shutdown(self) -> None:
        """Stop and join the engine loop, then the transfer threads."""

    def generate(self, command: AddRequest) -> AsyncGenerator[RequestOutput, None]:
        """Outputs as tokens arrive; the last has finished=True. Raises ValueError for input the engine refuses.
        Closing the iterator early aborts the request."""

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already ended)."""

    async def release(self, command: ReleaseRequest) -> bool:
        """P: free a finished request's pinned KV now (or abort it if still running); False when unknown."""

    async def abort_if_queued(self, request_id: str) -> bool:
        """Abort a request that has not left the engine's waiting queue; False when it has started or ended."""

    def refuse_transfer(self, source: PullSource | PushSource) -> None:
        """D: a request carrying these coordinates was refused before the engine had it; tell their producer to
        free that KV now (no-op while the engine is not ready)."""

    def stats(self) -> EngineStats:
        """The latest snapshot, with the observations made since the previous call."""

    def timelines(self) -> list[dict[str, Any]]:
        """Recent requests' event times (GET /timeline)."""

    @property
    def kv_events(self) -> KVEventLog:
        """The prefix cache's event log (GET /kv_events): the engine thread writes it, any thread reads it without
        the engine; raises RuntimeError before start()."""
