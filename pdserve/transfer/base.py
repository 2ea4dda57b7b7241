"""The connector contract between the engine and a KV transfer mode.

Each mode has two halves (two classes, never one class with two Optional halves):
- ConnectorScheduler lives beside the scheduler, runs on the engine thread only, never touches memory or
  the network; it turns request life-cycle events into a StepMeta once per engine step.
- ConnectorWorker lives beside the KV cache (one per worker / tensor-parallel rank), owns the NIXL agent
  through its transfer thread, executes StepMeta and reports TransferResults.

Only the plain data below crosses the boundary; this package never imports the engine.

Tensor parallelism (docs/architecture.md, "Tensor parallelism"): an instance of N ranks runs one
ConnectorScheduler (rank 0) and N ConnectorWorkers, one per rank process, each with its own NIXL agent,
transfer thread and side channel over its own slice of the KV cache (its KV heads, heads.py). Every rank's
worker gets the same StepMeta (rank 0's, forwarded as bytes by ranks.py) and works on its heads alone; rank 0
merges their TransferResults (ranks.RankMerger) before the engine sees them, so that for the engine a request
still ends in exactly one result:
- a recv is finished only when every rank's part landed; the first rank that fails it has the other ranks
  cancel theirs, and the request is reported failed (with that reason) once every rank's part is over, so no
  block is reused while any rank's READ/WRITE may still land in it; an engine cancel is reported cancelled;
- a send is finished (P's blocks may be freed) when every rank reported its part finished.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.groups import STALE
from pdserve.kv.params import KVAnswer, KVTransferParams, PullSource, PushSource


@dataclass(frozen=True)
class KVCacheSpec:
    """The registered KV cache: its geometry (kv/geometry.py: one contiguous, block-major buffer, whose sizes and
    byte offsets the geometry owns), where it is, and whose it is."""

    geometry: CacheGeometry  # blocks, layers per block, heads (this rank's and the model's), sizes, KV groups
    # where
    base_addr: int  # address of element 0 (host or device pointer)
    memory: str  # "DRAM" or "VRAM", as NIXL names it
    device_id: int  # GPU index for VRAM, 0 for DRAM
    # who
    model_name: str  # for the compatibility hash
    dtype: str  # "float32" | "bfloat16" | "float16"
    tp_rank: int = 0  # this rank
    tp_size: int = 1  # ranks of the instance
    rank_ports: tuple[int, ...] = ()  # rank 0: every rank's side-channel port (announced in its handshake)


@dataclass(frozen=True)
class RecvTask:
    """Decode side: receive KV for tokens [start_token, start_token + num_tokens) of a request."""

    request_id: str
    block_ids: tuple[int, ...]  # local blocks covering tokens [0, start_token + num_tokens), in order
    start_token: int  # tokens before this are already local (D's prefix cache); block aligned
    num_tokens: int  # tokens to receive; may be 0 (then only the producer is told to release)
    source: PullSource | PushSource  # where the KV comes from (the request's parsed kv_transfer_params)
    attempt: int = 0  # push: registration attempt; a new attempt never receives an older attempt's data
    # windowed models: every KV group's local table (STALE entries before a windowed group's window);
    # block_ids is then group 0's. (): one group, block_ids
    block_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return self.block_tables or (self.block_ids,)


@dataclass(frozen=True)
class SendTask:
    """Prefill side: a finished request's KV is ready to be consumed from these blocks."""

    request_id: str
    block_ids: tuple[int, ...]  # blocks covering tokens [0, num_tokens), in order
    num_tokens: int
    transfer_id: str | None = None  # push: pairs this prefill with D's registration
    # windowed models: every KV group's table (STALE entries before a windowed group's window); block_ids is
    # then group 0's. (): one group, block_ids
    block_tables: tuple[tuple[int, ...], ...] = ()
    # the token the prefill sampled after its num_tokens tokens (push: sent in the PushDone of a registration
    # ending at num_tokens, D's first output token); None: none sampled
    first_token_id: int | None = None

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return self.block_tables or (self.block_ids,)

    @property
    def pin_ids(self) -> tuple[int, ...]:
        """The blocks this send pins (what a pull answer and PullRelease name): block_ids, or for a windowed
        model every group's live blocks in group order."""
        return live_blocks(self.block_tables) if self.block_tables else self.block_ids


def live_blocks(tables: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Every non-STALE block id of the tables, in group order."""
    return tuple(b for t in tables for b in t if b != STALE)


@dataclass
class StepMeta:
    """Everything the scheduler side asks of the worker side in one engine step."""

    recvs: list[RecvTask] = field(default_factory=list)
    sends: list[SendTask] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # request ids of RecvTasks aborted before landing
    # P (push): (request id, transfer id) of requests that arrived and will hand their KV over as a SendTask;
    # each later ends as exactly one SendTask or one `abandoned` entry
    expected: list[tuple[str, str]] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)  # P: request ids of `expected` that ended without a send
    # P: request ids of finished sends whose pins the engine gives up now (an abort, POST /kv_transfer/release);
    # each still ends as one finished send (at once, or when a WRITE in flight is over)
    releases: list[str] = field(default_factory=list)
    # D: the coordinates of requests refused before admission (no RecvTask, no result follows): tell their
    # producer to free that KV now (thread/give_back.py)
    refusals: list[PullSource | PushSource] = field(default_factory=list)
    # P (push): requests whose prompt's last chunk was scheduled (ConnectorScheduler.on_prefill_scheduled), as
    # the SendTask they will hand over (no first_token_id yet): their WRITEs are laid out while P computes. Each
    # is an `expected` request and still ends as one SendTask or one `abandoned` entry
    planned: list[SendTask] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.recvs or self.sends or self.cancels or self.expected or self.abandoned or self.releases
            or self.refusals or self.planned
        )  # fmt: skip


@dataclass
class TransferResults:
    """What the worker side reports back; every list holds request ids (landed_from is keyed by them) and is
    drained once read."""

    finished_recvs: list[str] = field(default_factory=list)  # KV landed: the request may run
    failed_recvs: list[tuple[str, str]] = field(default_factory=list)  # (id, reason); blocks safe to reuse
    # of failed_recvs, those whose producer answered that it holds no such KV (its coordinates are stale, forged
    # or replayed): the request's own error, not the instance's
    refused_recvs: list[str] = field(default_factory=list)
    cancelled_recvs: list[str] = field(default_factory=list)  # aborted recvs whose blocks are safe to free
    finished_sends: list[str] = field(default_factory=list)  # P: blocks may be freed (consumed or expired)
    events: list[tuple[str, str, float]] = field(default_factory=list)  # (request id, event, time.time())
    # per finished recv: each KV group's first token whose KV landed (thread/landing.py); D's blocks hold only
    # rows from there on (rows before it in a windowed group's first block were never received: that block is
    # not registered in D's prefix cache). Absent: from the recv's start_token on
    landed_from: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # per finished recv whose KV ends where the prefill's does: the token the prefill sampled after it (pull: P's
    # answer's first_token_id; push: the PushDone's), D's first output token (kv.params.hands_first_token)
    first_tokens: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.finished_recvs or self.failed_recvs or self.cancelled_recvs or self.finished_sends or self.events
        )


@dataclass
class TransferStats:
    """Cumulative counters for /metrics (a snapshot; safe to read from any thread)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfers_expired: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # durations since the last snapshot
    # one entry per READ/WRITE posted since the last snapshot: (descriptors, seconds NIXL took to accept it)
    posts: list[tuple[int, float]] = field(default_factory=list)
    checksum_failures: int = 0  # --kv-checksum: recvs whose received KV did not match the producer's sums
    side_channel_refused: dict[str, int] = field(default_factory=dict)  # since start, by reason (side_admission.py)
    # P (push), now: WRITEs laid out before their prefill ended and not yet posted nor released
    # (thread/push_prepare.py); 0 when nothing waits
    prepared_writes: int = 0


class ConnectorScheduler(ABC):
    """Scheduler half. Invariants: called only from the engine thread; never blocks; never does I/O.
    Every request it is told about ends in exactly one of: finished send, finished/failed/cancelled recv,
    or (when it needs nothing) no task at all. The request (the engine's) owns its kv_transfer_params and
    passes them in; this half keeps no copy of them."""

    @abstractmethod
    def needs_remote_kv(self, request_id: str, params: KVTransferParams | None) -> bool:
        """A new request arrived; True if its prompt KV comes from a remote prefill (D side). Called for every
        request, so a P side learns here which transfers it will produce. Raises KVParamsError (a ValueError:
        the request is refused before anything is allocated) for params this instance cannot serve."""

    @abstractmethod
    def on_blocks_allocated(
        self,
        request_id: str,
        block_ids: list[int],
        num_local_tokens: int,
        num_prompt_tokens: int,
        source: PullSource | PushSource,
        block_tables: Sequence[Sequence[int]] = (),
        with_last_token: bool = False,
    ) -> None:
        """D: blocks for the whole prompt are allocated; tokens [0, num_local_tokens) hit D's prefix cache;
        source is the request's params for which needs_remote_kv() returned True. The recv covers the rest of the
        prompt when with_last_token (the prefill hands the first output token over: kv.params.hands_first_token),
        else all of it but the last token, which D computes itself. block_tables: for a windowed model, every KV
        group's table (block_ids is group 0's; a windowed group holds only the blocks of the window before the
        first token D computes, STALE before them); () otherwise."""

    @abstractmethod
    def on_request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        token_ids: Sequence[int] = (),
        block_tables: Sequence[Sequence[int]] = (),
    ) -> bool:
        """A request finished. Returns True to keep its blocks pinned until a finished send. token_ids: the
        request's tokens (prompt, then output); the first num_tokens are the ones whose KV the blocks hold, the
        one after them (when there is one) the token sampled last, which a decode instance emits as its first.
        block_tables: as in on_blocks_allocated (a windowed group keeps the window before token num_tokens - 1)."""

    def on_prefill_scheduled(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        block_tables: Sequence[Sequence[int]] = (),
    ) -> None:
        """P: the chunk that completes a request's prompt of num_tokens tokens was scheduled (before its forward
        pass); block_ids / block_tables (as in on_request_finished) are the blocks the finished prefill will hand
        over, unless they change before it ends. Push lays its WRITEs out now (StepMeta.planned); the default does
        nothing."""
        return None

    @abstractmethod
    def take_answer(self, request_id: str) -> KVAnswer | None:
        """P: the kv_transfer_params for a finished request's response (asked once, after
        on_request_finished); None when it has none."""

    @abstractmethod
    def on_request_aborted(self, request_id: str) -> None:
        """A request ended without finishing (abort or error) and holds no blocks a transfer may touch: forget
        it. P side: its prefill will never be handed over (push: a registration waiting for it is refused)."""

    @abstractmethod
    def on_pin_released(self, request_id: str) -> None:
        """P: the engine gives up a finished request's pinned blocks before its consumer is done (an abort, or
        the router's POST /kv_transfer/release after D's leg failed). The worker ends the send at once (pull: a
        later PullRelease is answered held=False, so D never runs on these blocks; push: a pending registration
        gets PushFail) or, with a WRITE in flight, when it is over; the blocks are freed on that finished send."""

    @abstractmethod
    def on_refused(self, source: PullSource | PushSource) -> None:
        """D: a request carrying these coordinates was refused before it was admitted (never allocated, never
        to run; the server checked any capability): the worker tells the producer to free that KV now instead
        of at its lease. No result follows."""

    @abstractmethod
    def on_recv_aborted(self, request_id: str) -> None:
        """D: a request waiting for KV was aborted; its blocks stay allocated until a cancelled recv."""

    @abstractmethod
    def build_step_meta(self) -> StepMeta:
        """Drain what happened since the last call."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What GET /kv_transfer/info returns (engine id, side channel host/port, tp size, block size, mode)."""


class ConnectorWorker(ABC):
    """Worker half. Invariants: owns the NIXL agent through exactly one transfer thread, which it starts in
    start() and joins in shutdown(); submit() and poll_results() never block on the network."""

    @abstractmethod
    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        """Register the KV cache buffer (a torch tensor laid out as in KVCacheSpec) once, before start()."""

    @abstractmethod
    def start(self, wakeup: Callable[[], None]) -> None:
        """Start the transfer thread; it calls wakeup() whenever new results are ready."""

    @abstractmethod
    def submit(self, meta: StepMeta) -> None:
        """Hand one step's tasks to the transfer thread."""

    @abstractmethod
    def poll_results(self) -> TransferResults:
        """Drain the results ready so far."""

    @abstractmethod
    def stats(self) -> TransferStats:
        """Cumulative counters (transfer_seconds is drained)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop and join the transfer thread, then release the agent."""
