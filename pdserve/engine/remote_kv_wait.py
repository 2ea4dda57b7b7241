"""D: requests waiting for their KV from a prefill instance (WAITING_FOR_REMOTE_KV), pure Python, no torch.

A decode-side request whose params name a source is parked here when the scheduler reaches it: it gets blocks for
its whole prompt (its own prefix hits first) and the connector is told where to write. It holds them until the
worker reports the KV landed (it then waits for its first step, with the prefill's first output token appended
where that came along), failed (recompute locally or fail) or, for one aborted meanwhile, that nothing more can
land in its blocks. The scheduler's step loop (scheduler.py) only calls park(); the engine applies the worker's
results through the scheduler's on_kv_* methods, which come here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pdserve.engine.admissions import AdmissionCounts
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.block_tables import BlockTables
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv.groups import STALE, KVGroups
from pdserve.kv.params import PullSource, PushSource, hands_first_token
from pdserve.transfer.base import ConnectorScheduler


class RemoteKVWaits:
    """The parked requests (KV in flight) and those aborted while parked, of one scheduler (engine thread)."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_model_len: int,
        kv_groups: KVGroups,
        connector: ConnectorScheduler,
        tables: BlockTables,
        prefix_cache: PrefixCache,
        admitted: AdmissionCounts,
        waiting: deque[Request],  # the scheduler's waiting queue: parked from its head, put back at its head
        cache_received_kv: bool,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_groups = kv_groups
        self.connector = connector
        self.tables = tables
        self.prefix_cache = prefix_cache
        self.admitted = admitted
        self.waiting = waiting
        # True only where received KV is proven to be of the request's prompt (a deployment secret: D checked P's
        # signed digest of the tokens). Without that proof a client could pair its prompt with another prompt's
        # KV; registering those blocks under its prompt's hashes would serve them to every later request with
        # that prefix. Unproven KV serves its own request only (which runs on what its client pointed it at);
        # later requests get their prompt's KV moved again, so their greedy output is unchanged.
        self.cache_received_kv = cache_received_kv
        self.waiting_for_kv: dict[str, Request] = {}  # blocks allocated, KV in flight
        self.aborting: dict[str, Request] = {}  # aborted while KV in flight; blocks freed on cancel ack

    def park(self, req: Request) -> bool:
        """Allocate blocks for the whole prompt (prefix hits first) of the waiting queue's head and wait for the
        rest to be written; False (nothing held) when the blocks are not there."""
        source = req.kv_transfer_params
        if not isinstance(source, PullSource | PushSource):
            raise RuntimeError(f"request {req.request_id} waits for remote KV without a source in its params")
        self.prefix_cache.take_hits(req)
        # the prefill's first output token comes with KV of the whole prompt, or D computes the last prompt token
        # (unless its position n needs a block more than the whole pool has: then D computes position n - 1)
        n = req.num_prompt_tokens
        req.first_token_from_prefill = (
            hands_first_token(source, n) and -(-(n + 1) // self.block_size) <= self.pool.num_blocks
        )
        first_computed = n - (0 if req.first_token_from_prefill else 1)  # D's first position
        for g, table in enumerate(req.block_tables):  # a windowed group needs only the window before it
            first = self.kv_groups.first_live_block(g, first_computed, self.block_size)
            table.extend([STALE] * (first - len(table)))
        # blocks up to D's first position: once the KV landed its first step needs no new block, so a pool full
        # of landed requests always makes progress (the waiting branch of schedule() never preempts)
        if not self.tables.allocate_to(req, first_computed + 1):
            self.tables.free(req)
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.admitted.start(req)
        self.waiting_for_kv[req.request_id] = req
        self.connector.on_blocks_allocated(
            req.request_id, list(req.block_ids), req.num_computed_tokens, req.num_prompt_tokens, source,
            block_tables=self.tables.for_transfer(req), with_last_token=req.first_token_from_prefill,
        )  # fmt: skip
        return True

    def abort(self, req: Request) -> None:
        """A parked request ends; its blocks are kept until the worker confirms nothing more can land in them."""
        del self.waiting_for_kv[req.request_id]
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        self.aborting[req.request_id] = req
        self.connector.on_recv_aborted(req.request_id)

    def on_received(
        self, request_id: str, landed_from: Sequence[int] = (), first_token: int | None = None
    ) -> Request | None:
        """See Scheduler.on_kv_received."""
        if (req := self.aborting.pop(request_id, None)) is not None:
            self.tables.free(req)
            return None
        req = self.waiting_for_kv.pop(request_id)
        req.remote_kv_ready = True
        req.kv_valid_from = list(landed_from)
        req.cache_blocks = self.cache_received_kv
        req.num_cached_tokens = req.num_computed_tokens = req.num_prompt_tokens - (0 if first_token is not None else 1)
        req.status = RequestStatus.WAITING
        req.mark("kv_received")
        self.waiting.appendleft(req)
        if first_token is None:
            return None
        self.prefix_cache.cache_full_blocks(req)  # as a step would (one that stops at this token never steps)
        req.append_output(first_token, self.max_model_len)
        return req

    def on_failed(self, request_id: str, recompute: bool) -> Request | None:
        """See Scheduler.on_kv_failed."""
        if (req := self.aborting.pop(request_id, None)) is not None:
            self.tables.free(req)
            return None
        req = self.waiting_for_kv.pop(request_id)
        req.status = RequestStatus.WAITING
        if recompute:
            req.needs_remote_kv = False
            req.num_cached_tokens = req.num_computed_tokens  # only D's own prefix-cache hits are valid
            if self.kv_groups.is_windowed:  # its windowed tables are STALE where the prompt is recomputed
                self.tables.free(req)  # start over (prefix hits are taken again when it is scheduled)
                req.num_computed_tokens = req.num_cached_tokens = req.num_hashed_blocks = 0
            self.waiting.appendleft(req)
            return None
        self.waiting.appendleft(req)  # finish() removes it from waiting
        return req

    def on_cancelled(self, request_id: str) -> None:
        """The worker confirmed an aborted request's recv is over: its blocks are free to reuse."""
        if (req := self.aborting.pop(request_id, None)) is not None:
            self.tables.free(req)
