"""One engine's snapshot for GET /metrics: the scheduler's queues and admissions, the block pool, the step
loop's counters and the KV connector's transfer counters, gathered into client.EngineStats (engine thread)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.client import EngineStats
from pdserve.engine.scheduler import Scheduler
from pdserve.transfer.base import TransferStats


@dataclass(frozen=True)
class StepCounters:
    """The step loop's own counters at the snapshot (LLMEngine keeps them)."""

    num_steps: int  # step() calls so far
    num_step_failures: int  # steps whose forward pass raised (their requests failed)
    transfer_hook_seconds: float  # engine-thread seconds spent in the connector hooks (cumulative)


def engine_stats(
    scheduler: Scheduler, pool: BlockPool, num_blocks: int, steps: StepCounters, t: TransferStats
) -> EngineStats:
    """The snapshot; num_blocks: the KV cache's blocks (the pool's total)."""
    s = scheduler
    return EngineStats(
        num_blocks_total=num_blocks,
        num_blocks_free=pool.num_free,
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        num_waiting_for_kv=len(s.waiting_for_kv),
        kv_sent_bytes=t.sent_bytes,
        kv_received_bytes=t.received_bytes,
        transfers_ok=t.transfers_ok,
        transfers_failed=t.transfers_failed,
        transfers_expired=t.transfers_expired,
        kv_checksum_failures=t.checksum_failures,
        num_engine_steps=steps.num_steps,
        transfer_hook_seconds=steps.transfer_hook_seconds,
        num_step_failures=steps.num_step_failures,
        num_requests_started=s.admitted.num_requests,
        num_prompt_tokens=s.admitted.num_prompt_tokens,
        num_prefix_hit_tokens=s.admitted.num_prefix_hit_tokens,
        num_prepared_writes=t.prepared_writes,
        side_channel_refused=dict(t.side_channel_refused),
    )
