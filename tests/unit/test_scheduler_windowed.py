"""Scheduler with a sliding-window KV group under P/D (no torch): P keeps the window before the last prompt token,
D allocates only that window's blocks and recomputes from fresh blocks after a failed transfer."""

from test_scheduler import SOURCE, TO_DECODE, RecordingConnector, req, run_step

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.groups import STALE, KVGroups

GROUPS = KVGroups.of((None, 8), 2)  # layer 0 full (group 0), layer 1 a window of 8 (group 1)
N = 23  # D computes token 22 itself; its query reads keys 15..22: blocks 3.. of 4 tokens (P's own next query: 4..)


class TablesConnector(RecordingConnector):
    def __init__(self, block_size):
        super().__init__(block_size)
        self.tables = {}  # request id -> block_tables the scheduler passed

    def on_blocks_allocated(self, request_id, block_ids, num_local, num_prompt, source, block_tables=(), **kw):
        super().on_blocks_allocated(request_id, block_ids, num_local, num_prompt, source, **kw)
        self.tables[request_id] = [list(t) for t in block_tables]

    def on_request_finished(self, request_id, block_ids, num_tokens, params, token_ids=(), block_tables=()):
        self.tables[request_id] = [list(t) for t in block_tables]
        return super().on_request_finished(request_id, block_ids, num_tokens, params, token_ids)


def make():
    pool = BlockPool(64, True)
    conn = TablesConnector(4)
    return Scheduler(SchedulerConfig(8, 64), pool, 4, 1024, conn, GROUPS), pool, conn


def test_prefill_keeps_the_window_before_the_last_prompt_token():
    s, pool, conn = make()
    s.add(req("p", N, max_tokens=1, params=TO_DECODE))
    run_step(s)
    full, windowed = conn.tables["p"]
    assert len(full) == 6 and STALE not in full
    assert windowed[:3] == [STALE] * 3 and STALE not in windowed[3:]  # block 3 holds key 15
    assert pool.num_free == 64 - 9  # pinned until the send finishes
    s.on_send_finished("p")
    assert pool.num_free == 64


def test_decode_allocates_only_the_window_and_recomputes_from_fresh_blocks():
    s, pool, conn = make()
    s.add(req("d", N, params=SOURCE))
    run_step(s)
    full, windowed = conn.tables["d"]
    assert len(full) == 6 and windowed == [STALE] * 3 + windowed[3:] and len(windowed) == 6
    assert pool.num_free == 64 - 9
    assert s.on_kv_failed("d", recompute=True) is None
    assert pool.num_free == 64  # the STALE tables are dropped: the prompt is recomputed into fresh blocks
    out = run_step(s)
    assert out.chunks[0].start_pos == 0 and all(STALE not in t for t in out.chunks[0].block_tables)


def test_a_partly_received_window_block_never_serves_a_prefix_hit():
    """D's window block 3 holds tokens 12..15; a prefill with 2-token blocks held (and sent) only keys 14.. of
    it (landed_from). Attention never reads rows 12, 13 (before the window), but a later request resuming at
    token 20 would: the block is not registered, so the same prompt again gets no prefix hit. With the whole
    block received (equal block sizes) it does."""
    for landed, hit in (((0, 14), 0), ((0, 12), 20)):
        s, pool, conn = make()
        s.add(req("d", N, max_tokens=2, params=SOURCE))
        run_step(s)
        s.on_kv_received("d", landed)
        assert s.requests["d"].kv_valid_from == list(landed)
        while s.has_work():
            run_step(s)
        assert pool.num_free == 64
        s.add(req("e", N, params=SOURCE))
        run_step(s)
        assert s.requests["e"].num_computed_tokens == hit, landed
        assert s.requests["e"].kv_valid_from == []  # a new request: nothing received yet
