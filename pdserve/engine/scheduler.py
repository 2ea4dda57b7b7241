"""Scheduler: one token-budget loop over running then waiting requests (pure Python, no torch).

Every step each scheduled request's num_computed_tokens catches up with its token count, within the step's
token budget (chunked prefill); decodes and prefill chunks share one batch. When blocks run out the newest
running request is preempted by recompute. P/D adds one status, WAITING_FOR_REMOTE_KV: a decode-side request
holds its blocks there until its KV has landed, then computes only its last prompt token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.engine.request import Request, RequestStatus
from pdserve.model.kv_groups import STALE, KVGroups
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import ConnectorScheduler
from pdserve.transfer.params import PullSource, PushSource, RemoteDecode


@dataclass
class ScheduledChunk:
    """Tokens of one request to compute in this step (the worker's input for that request)."""

    request_id: str
    token_ids: list[int]  # tokens at positions [start_pos, start_pos + len)
    start_pos: int  # = the request's num_computed_tokens before this step
    block_tables: list[list[int]]  # the request's blocks per KV group (covering start_pos + len tokens)
    sample: bool  # this chunk ends at the request's last token: sample the next one
    params: SamplingParams
    num_output_tokens: int  # generated so far (sampling seed step)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's blocks (all of them for a one-group model)."""
        return self.block_tables[0]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    out_of_blocks: list[Request] = field(default_factory=list)  # alone and still no block: finish ("length")

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        max_model_len: int,
        connector: ConnectorScheduler,
        kv_groups: KVGroups | None = None,  # default: one group of full-attention layers
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.kv_groups = kv_groups or KVGroups.of((), 1)
        self.max_model_len = max_model_len
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # D: blocks allocated, KV in flight
        self.pinned: dict[str, Request] = {}  # P: finished, blocks kept until the consumer is done
        self.aborting: dict[str, Request] = {}  # D: aborted while KV in flight; blocks freed on cancel ack
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
                token_ids=req.token_slice(0, req.num_computed_tokens), block_tables=self._transfer_tables(req),
            )  # fmt: skip
        else:  # abort or error: nothing to hand over (push: P refuses D's registration at once)
            self.connector.on_request_aborted(req.request_id)
        if keep:
            self.pinned[req.request_id] = req
        else:
            self._free_blocks(req)

    def abort(self, request_id: str) -> Request | None:
        """Abort an unfinished request; a request whose KV is in flight keeps its blocks until the worker
        confirms nothing more can land in them."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
            del self.requests[request_id]
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            self.aborting[request_id] = req
            self.connector.on_recv_aborted(request_id)
            return req
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
    def on_kv_received(self, request_id: str, landed_from: Sequence[int] = ()) -> None:
        """The KV landed; landed_from: per KV group, the first token it holds (TransferResults.landed_from)."""
        if (req := self.aborting.pop(request_id, None)) is not None:
            self._free_blocks(req)
            return
        req = self.waiting_for_kv.pop(request_id)
        req.remote_kv_ready = True
        req.kv_valid_from = list(landed_from)
        req.num_cached_tokens = req.num_prompt_tokens - 1
        req.num_computed_tokens = req.num_prompt_tokens - 1
        req.status = RequestStatus.WAITING
        req.mark("kv_received")
        self.waiting.appendleft(req)

    def on_kv_failed(self, request_id: str, recompute: bool) -> Request | None:
        """KV will not arrive (blocks are safe to reuse). Recompute locally, or return the request to fail."""
        if (req := self.aborting.pop(request_id, None)) is not None:
            self._free_blocks(req)
            return None
        req = self.waiting_for_kv.pop(request_id)
        req.status = RequestStatus.WAITING
        if recompute:
            req.needs_remote_kv = False
            req.num_cached_tokens = req.num_computed_tokens  # only D's own prefix-cache hits are valid
            if self.kv_groups.is_windowed:  # its windowed tables are STALE where the prompt is recomputed
                self._free_blocks(req)  # start over (prefix hits are taken again when it is scheduled)
                req.num_computed_tokens = req.num_cached_tokens = req.num_hashed_blocks = 0
            self.waiting.appendleft(req)
            return None
        self.waiting.appendleft(req)  # finish() removes it from waiting
        return req

    def on_recv_cancelled(self, request_id: str) -> None:
        if (req := self.aborting.pop(request_id, None)) is not None:
            self._free_blocks(req)

    def on_send_finished(self, request_id: str) -> None:
        if (req := self.pinned.pop(request_id, None)) is not None:
            self._free_blocks(req)

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
                if not self._park_for_remote_kv(req):
                    break
                continue
            if not req.block_ids:
                self._take_prefix_hits(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_to(req, req.num_computed_tokens + num_new):
                if not req.remote_kv_ready and req.num_computed_tokens == req.num_cached_tokens:
                    self._free_blocks(req)  # give prefix hits back; retried next step
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
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
            self._cache_full_blocks(req)
            self._free_out_of_window(req)
            token = sampled.get(chunk.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            p = req.params
            if (token in req.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                req.finish_reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                stopped.append(req)
        return stopped

    # ---- helpers ------------------------------------------------------------------------------------------
    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        tokens = req.token_slice(start, start + num_new)  # not all_token_ids: O(context) per step
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=tokens,
            start_pos=start,
            block_tables=[list(t) for t in req.block_tables],
            sample=start + num_new == req.num_tokens,
            params=req.params,
            num_output_tokens=len(req.output_token_ids),
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _allocate_to(self, req: Request, num_tokens: int) -> bool:
        """Grow every group's table to hold num_tokens; False (nothing taken) when the pool has too few blocks."""
        want = self._blocks_for(num_tokens)
        needs = [want - len(t) for t in req.block_tables]
        if sum(n for n in needs if n > 0) > self.pool.num_free:
            return False
        for table, need in zip(req.block_tables, needs, strict=True):
            if need > 0:
                last = table[-1] if table and table[-1] != STALE else None
                table.extend(self.pool.allocate(need, after=last))
        return True

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give a running request blocks for num_tokens, preempting the newest running requests if needed.
        Returns False if req itself had to be preempted."""
        while not self._allocate_to(req, num_tokens):
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
        self._free_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        req.remote_kv_ready = False
        req.needs_remote_kv = False  # its KV is gone; recompute locally
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_blocks(self, req: Request) -> None:
        for table in req.block_tables:
            self.pool.free(b for b in reversed(table) if b != STALE)
        req.block_tables = [[] for _ in self.kv_groups.groups]
        req.kv_valid_from = []

    def _transfer_tables(self, req: Request) -> list[list[int]]:
        """What the connector hooks get as block_tables: every group's table for a windowed model, else []."""
        return [list(t) for t in req.block_tables] if self.kv_groups.is_windowed else []

    def _free_out_of_window(self, req: Request) -> None:
        """Give back every windowed group's blocks that no later query of the request can read. P keeps one
        token more for a request it hands to a remote decode: D computes the last prompt token itself, so it
        needs the window before that token (position num_computed - 1)."""
        keep_from = req.num_computed_tokens - (1 if isinstance(req.kv_transfer_params, RemoteDecode) else 0)
        for g, table in enumerate(req.block_tables):
            first = min(self.kv_groups.first_live_block(g, keep_from, self.block_size), len(table))
            dead = [b for b in table[:first] if b != STALE]
            if dead:
                self.pool.free(reversed(dead))  # registered ones stay evictable prefix-cache entries
                table[:first] = [STALE] * first

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first num_blocks full blocks (memoised on the request)."""
        bs = self.block_size
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))
        return req.block_hashes[:num_blocks]

    def _take_prefix_hits(self, req: Request) -> None:
        # at least one token must be computed (its logits give the next token), so cap at num_tokens - 1
        max_blocks = (req.num_tokens - 1) // self.block_size
        tables = self._prefix_hits(self._hashes(req, max_blocks)) if self.pool.enable_prefix_caching else []
        if not tables:
            tables = [[] for _ in self.kv_groups.groups]
        for table in tables:
            self.pool.touch(b for b in table if b != STALE)
        req.block_tables = tables
        num_hits = len(tables[0])
        req.num_computed_tokens = req.num_cached_tokens = num_hits * self.block_size
        req.num_hashed_blocks = num_hits

    def _group_hash(self, group: int, block_hash: bytes) -> bytes:
        """Prefix-cache key of a block of `group` (group 0 keeps the plain chained hash)."""
        return block_hash if group == 0 else group.to_bytes(2, "little") + block_hash

    def _prefix_hits(self, hashes: list[bytes]) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix every group can resume from ([] if none): a
        full-attention group needs all its blocks cached, a windowed group only those of the window before the
        first position computed; the table entries before them are STALE."""
        groups, bs = self.kv_groups.groups, self.block_size
        full = [g for g, group in enumerate(groups) if group.window is None]
        cached = [self.pool.lookup([self._group_hash(g, h) for h in hashes]) for g in full]
        k = min((len(c) for c in cached), default=len(hashes))
        for num in range(k, 0, -1):
            tables: list[list[int]] = []
            for g in range(len(groups)):
                if groups[g].window is None:
                    tables.append(cached[full.index(g)][:num])
                    continue
                first = self.kv_groups.first_live_block(g, num * bs, bs)
                live = [self.pool.cached_block(self._group_hash(g, h)) for h in hashes[first:num]]
                if any(b is None for b in live):
                    break
                tables.append([STALE] * first + [b for b in live if b is not None])
            else:
                return tables
        return []

    def _park_for_remote_kv(self, req: Request) -> bool:
        """D: allocate blocks for the whole prompt (prefix hits first) and wait for the rest to be written."""
        self._take_prefix_hits(req)
        # a windowed group needs only the window before the last prompt token (D computes that token itself)
        for g, table in enumerate(req.block_tables):
            first = self.kv_groups.first_live_block(g, req.num_prompt_tokens - 1, self.block_size)
            table.extend([STALE] * (first - len(table)))
        if not self._allocate_to(req, req.num_prompt_tokens):
            self._free_blocks(req)
            return False
        source = req.kv_transfer_params
        if not isinstance(source, PullSource | PushSource):
            raise RuntimeError(f"request {req.request_id} waits for remote KV without a source in its params")
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[req.request_id] = req
        self.connector.on_blocks_allocated(
            req.request_id, list(req.block_ids), req.num_computed_tokens, req.num_prompt_tokens, source,
            block_tables=self._transfer_tables(req),
        )  # fmt: skip
        return True

    def _cache_full_blocks(self, req: Request) -> None:
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_hashed_blocks or not self.pool.enable_prefix_caching:
            return
        hashes = self._hashes(req, num_full)
        for g, table in enumerate(req.block_tables):
            # a block with rows D never received (before kv_valid_from) must not serve another request
            valid_from = req.kv_valid_from[g] if req.kv_valid_from else 0
            for i in range(req.num_hashed_blocks, num_full):
                if table[i] != STALE and i * self.block_size >= valid_from:
                    self.pool.cache(table[i], self._group_hash(g, hashes[i]))
        req.num_hashed_blocks = num_full
