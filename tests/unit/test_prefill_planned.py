"""Scheduler -> PushScheduler.on_prefill_scheduled (StepMeta.planned): the blocks a push prefill leg announces
when its prompt's last chunk is scheduled are exactly those its finished SendTask names (else every prepared
WRITE is laid out again: thread/push_prepare.py's fits()), announced once per schedule of that chunk, and only
for a prefill leg. Pure Python: the real Scheduler, BlockPool and PushScheduler, no transfer thread."""

from pdserve.config import SchedulerConfig, TransferConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.groups import KVGroups
from pdserve.kv.params import Mode, RemoteDecode
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.layout import group_ranges
from pdserve.transfer.scheduler.push import PushScheduler
from pdserve.transfer.thread.push_prepare import used_blocks


def make(budget: int, num_blocks: int = 64) -> tuple[Scheduler, PushScheduler]:
    push = PushScheduler(TransferConfig(role="prefill", mode="push"), 4, "127.0.0.1", 5600)
    return Scheduler(SchedulerConfig(8, budget), BlockPool(num_blocks, True), 4, 1024, push), push


def leg(rid: str, n: int) -> Request:
    """A push prefill leg of n tokens (P samples its one token)."""
    return Request(rid, list(range(n)), SamplingParams.greedy(1), (), RemoteDecode(Mode.PUSH, f"t-{rid}"))


def step(s: Scheduler) -> None:
    out = s.schedule()
    for r in s.update(out, {c.request_id: 7 for c in out.chunks if c.sample}):
        s.finish(r, r.finish_reason or "length")


def test_planned_once_at_the_last_chunk_with_the_finished_blocks() -> None:
    s, push = make(budget=8)
    s.add(leg("a", 20))
    s.add(Request("whole", list(range(100, 106)), SamplingParams.greedy(2), (), None))  # no prefill leg
    planned = []
    sends = []
    for _ in range(4):
        step(s)
        meta = push.build_step_meta()
        planned += meta.planned
        sends += meta.sends
    assert [p.request_id for p in planned] == ["a"]  # the 3rd chunk (16..20) only, not "whole"
    assert [x.request_id for x in sends] == ["a"]
    p, x = planned[0], sends[0]
    assert (p.transfer_id, p.num_tokens) == ("t-a", 20) == (x.transfer_id, x.num_tokens)
    assert p.tables == x.tables  # what fits() compares: a prepared WRITE is used as laid out


def test_prefix_hit_leg_plans_its_shared_blocks() -> None:
    s, push = make(budget=64)
    s.add(leg("a", 16))
    step(s)
    push.build_step_meta()
    s.add(leg("b", 16))  # the same 16 tokens: 3 full blocks hit, the last token computed again
    step(s)
    meta = push.build_step_meta()
    assert [p.request_id for p in meta.planned] == ["b"] and [x.request_id for x in meta.sends] == ["b"]
    assert meta.planned[0].tables == meta.sends[0].tables


def test_windowed_leg_plans_the_blocks_its_write_reads() -> None:
    """A windowed group frees its blocks before the window after each chunk (STALE in the finished tables), but
    the blocks a WRITE of the whole prompt reads (group_ranges) are the ones planned: the prepared WRITE fits."""
    windows = (None, None, 8, 8)
    push = PushScheduler(TransferConfig(role="prefill", mode="push"), 4, "127.0.0.1", 5600)
    groups = KVGroups.of(windows, 4)
    s = Scheduler(SchedulerConfig(8, 8), BlockPool(64, True), 4, 1024, push, groups)
    s.add(leg("w", 22))
    planned, sends = [], []
    for _ in range(4):
        step(s)
        meta = push.build_step_meta()
        planned += meta.planned
        sends += meta.sends
    (p,), (x,) = planned, sends
    assert p.tables != x.tables  # blocks before the window were freed after the last chunk ran
    group_windows = [g.window for g in groups.groups]
    ranges = group_ranges(group_windows, 0, 22, 4, 4)
    assert used_blocks(p.tables, ranges, 4) == used_blocks(x.tables, ranges, 4)
