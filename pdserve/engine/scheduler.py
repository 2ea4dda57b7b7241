"""Scheduler: one token-budget loop over running then waiting requests (pure Python, no torch).

Every step each scheduled request's num_computed_tokens catches up with its token count, within the step's
token budget (chunked prefill); decodes and prefill chunks share one batch. When blocks run out the newest
running request is preempted by recompute. P/D adds one status, WAITING_FOR_REMOTE_KV: a decode-side request
holds its blocks there until its KV has landed; then it has its first output token from the prefill (appended
at once) or computes only its last prompt token. Those parked requests are remote_kv_wait.py's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pdserve.config import SchedulerConfig
from pdserve.engine.admissions import AdmissionCounts
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.block_tables import BlockTables
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.remote_kv_wait import RemoteKVWaits
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.kv.groups import KVGroups
from pdserve.kv.params import PullSource, PushSource
from pdserve.transfer.base import ConnectorScheduler


class Scheduler:
    """Owns the request queues (waiting, running, waiting for KV, pinned, aborting) and plans each step."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        max_model_len: int,
        connector: ConnectorScheduler,
        kv_groups: KVGroups | None = None,  # default: one group of full-attention layers
        cache_received_kv: bool = True,  # D: KV received from a prefill may enter the prefix cache (remote_kv_wait.py)
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.kv_groups = kv_groups or KVGroups.of((), 1)
        self.max_model_len = max_model_len
        self.connector = connector
        self.tables = BlockTables(pool, block_size, self.kv_groups)  # requests' blocks per KV group
        self.prefix_cache = PrefixCache(pool, block_size, self.kv_groups)  # hits at admission, blocks after steps
        self.admitted = AdmissionCounts()  # requests, prompt tokens and prefix hits, each request once (/metrics)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # D: requests parked until their KV lands, and those aborted meanwhile (remote_kv_wait.py);
        # cache_received_kv: whether received KV may enter the prefix cache (RemoteKVWaits.cache_received_kv)
        self.remote_kv = RemoteKVWaits(
            pool, block_size, max_model_len, self.kv_groups, connector, self.tables, self.prefix_cache,
            self.admitted, self.waiting, cache_received_kv,
        )  # fmt: skip
        self.waiting_for_kv = self.remote_kv.waiting_for_kv  # D: blocks allocated, KV in flight (the same dict)
        self.pinned: dict[str, Request] = {}  # P: finished, blocks kept until the consumer is done
        self.aborting = self.remote_kv.aborting  # D: aborted while KV in flight; blocks freed on cancel ack
        self.requests: dict[str, Request] = {}  # every unfinished request by id

    # ---- life cycle -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request; raises KVParamsError (nothing queued) for params the connector cannot serve."""
        req.needs_remote_kv = self.connector.needs_remote_kv(req.request_id, req.kv_transfer_params)
        req.block_tables = [[] for _ in self.kv_groups.groups]
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request: free its blocks, or pin them (P) while the connector hands its KV over."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            raise RuntimeError("finish a request waiting for KV through abort()")
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        self.requests.pop(req.request_id, None)
        keep = False
        if reason in ("stop", "length"):
            keep = self.connector.on_request_finished(
                req.request_id, list(req.block_ids), req.num_computed_tokens, req.kv_transfer_params,
                token_ids=req.token_slice(0, req.num_tokens), block_tables=self.tables.for_transfer(req),
            )  # fmt: skip
        else:  # abort or error: nothing to hand over (push: P refuses D's registration at once)
            self.connector.on_request_aborted(req.request_id)
            source = req.kv_transfer_params
            if reason == "abort" and req.needs_remote_kv and not req.remote_kv_ready:  # D: before its KV was asked
                if isinstance(source, PullSource | PushSource):  # for (queued, never parked): P frees it now
                    self.connector.on_refused(source)
        if keep:
            self.pinned[req.request_id] = req
        else:
            self.tables.free(req)

    def abort(self, request_id: str) -> Request | None:
        """Abort an unfinished request; a request whose KV is in flight keeps its blocks until the worker
        confirms nothing more can land in them."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.requests[request_id]
            self.remote_kv.abort(req)
            return req
        self.finish(req, "abort")
        return req

    def abort_if_queued(self, request_id: str) -> Request | None:
        """Abort a request that never left the waiting queue (--max-queue-wait-s); None when it has started
        (computing, or waiting for its remote KV) or is unknown."""
        req = self.requests.get(request_id)
        if req is None or req.has_started or req.status != RequestStatus.WAITING:
            return None
        self.finish(req, "abort")
        return req

    def release_pin(self, request_id: str) -> Request | None:
        """P: give up a finished request's pin now (abort, or D's leg failed). Its blocks are freed on the
        finished send the connector reports (at once, or after a WRITE in flight); None if it is not pinned."""
        req = self.pinned.get(request_id)
        if req is not None and not req.pin_released:
            req.pin_released = True
            self.connector.on_pin_released(request_id)
        return req

    # ---- transfer results ---------------------------------------------------------------------------------
    def on_kv_received(
        self, request_id: str, landed_from: Sequence[int] = (), first_token: int | None = None
    ) -> Request | None:
        """The KV landed; landed_from: per KV group, the first token it holds (TransferResults.landed_from);
        first_token: the prefill's first output token, given for a request that takes it (first_token_from_prefill:
        its KV covers the whole prompt). That token is appended as a sampled one is (stop conditions included) and
        the request returned, for the engine to emit it before the next step; None when there is none."""
        return self.remote_kv.on_received(request_id, landed_from, first_token)

    def on_kv_failed(self, request_id: str, recompute: bool) -> Request | None:
        """KV will not arrive (blocks are safe to reuse). Recompute locally, or return the request to fail."""
        return self.remote_kv.on_failed(request_id, recompute)

    def on_recv_cancelled(self, request_id: str) -> None:
        self.remote_kv.on_cancelled(request_id)

    def on_send_finished(self, request_id: str) -> None:
        if (req := self.pinned.pop(request_id, None)) is not None:
            self.tables.free(req)

    # ---- the step ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + num_new, out):
                if out.out_of_blocks:
                    break  # req is the only running request and cannot grow
                continue  # req itself was preempted; running[i] is now the next request (or none)
            out.chunks.append(self._chunk(req, num_new))
            budget -= num_new
            i += 1
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.cfg.max_num_seqs
            and not (out.preempted_ids or out.out_of_blocks)
        ):
            req = self.waiting[0]
            if req.needs_remote_kv and not req.remote_kv_ready:
                if not self.remote_kv.park(req):
                    break
                continue
            if not req.block_ids:
                self.prefix_cache.take_hits(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.tables.allocate_to(req, req.num_computed_tokens + num_new):
                if not req.remote_kv_ready and req.num_computed_tokens == req.num_cached_tokens:
                    self.tables.free(req)  # give prefix hits back; retried next step
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.admitted.start(req)
            req.mark("scheduled")
            self.running.append(req)
            out.chunks.append(self._chunk(req, num_new))
            budget -= num_new
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Account computed tokens, append sampled tokens; returns requests that hit a stop condition."""
        stopped = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += len(chunk.token_ids)
            self.prefix_cache.cache_full_blocks(req)
            self.tables.free_out_of_window(req)
            token = sampled.get(chunk.request_id)
            if token is not None and req.append_output(token, self.max_model_len):
                stopped.append(req)
        return stopped

    # ---- helpers ------------------------------------------------------------------------------------------
    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        tokens = req.token_slice(start, start + num_new)  # not all_token_ids: O(context) per step
        sample = start + num_new == req.num_tokens
        if sample and not req.output_token_ids and req.kv_transfer_params is not None:
            # the prompt's last chunk: the blocks a prefill leg hands over are known now (push prepares its WRITEs)
            self.connector.on_prefill_scheduled(
                req.request_id, list(req.block_ids), req.num_tokens, req.kv_transfer_params,
                block_tables=self.tables.for_transfer(req),
            )  # fmt: skip
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=tokens,
            start_pos=start,
            block_tables=[list(t) for t in req.block_tables],
            sample=sample,
            params=req.params,
            num_output_tokens=len(req.output_token_ids),
        )

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give a running request blocks for num_tokens, preempting the newest running requests if needed.
        Returns False if req itself had to be preempted."""
        while not self.tables.allocate_to(req, num_tokens):
            if self.running == [req]:  # nobody left to preempt: the cache cannot hold this request
                out.out_of_blocks.append(req)  # stays in running; the engine finishes it
                req.finish_reason = "length"
                return False
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.tables.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        req.remote_kv_ready = False
        req.needs_remote_kv = False  # its KV is gone; recompute locally
        req.num_preemptions += 1
        self.waiting.appendleft(req)
