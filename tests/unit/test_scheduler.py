"""Scheduler: token budget, chunked prefill, preemption, prefix hits, remote-KV parking (no torch)."""

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.params import PullSource, PushSource, RemoteDecode
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.nop import NopScheduler


class RecordingConnector(NopScheduler):
    """A scheduler-side connector that treats requests with do_remote_prefill as remote (the real pull/push
    schedulers do the same) and records what the scheduler told it."""

    def __init__(self, block_size):
        super().__init__(block_size)
        self.allocated = []
        self.finished = []
        self.aborted = []  # on_recv_aborted (D)
        self.ended = []  # on_request_aborted (abort or error, P and D)

    def needs_remote_kv(self, request_id, params):
        return isinstance(params, PullSource | PushSource)

    def on_blocks_allocated(
        self, request_id, block_ids, num_local_tokens, num_prompt_tokens, source, block_tables=(), with_last_token=False
    ):
        self.allocated.append((request_id, list(block_ids), num_local_tokens, num_prompt_tokens))
        self.with_last_token = with_last_token

    def on_request_finished(self, request_id, block_ids, num_tokens, params, token_ids=(), block_tables=()):
        self.finished.append(request_id)
        return isinstance(params, RemoteDecode)

    def on_recv_aborted(self, request_id):
        self.aborted.append(request_id)

    def on_request_aborted(self, request_id):
        self.ended.append(request_id)


SOURCE = PullSource("127.0.0.1", 5600, None, "p-1", (0, 1, 2), 10, 4)  # D: KV comes from a prefill instance
TO_DECODE = RemoteDecode(None, None)  # P: KV goes to a decode instance


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, caching=True):
    pool = BlockPool(num_blocks, caching)
    conn = RecordingConnector(block_size)
    s = Scheduler(SchedulerConfig(max_seqs, budget), pool, block_size, 1024, conn)
    return s, pool, conn


def req(rid, n, max_tokens=4, start=0, params=None):
    return Request(rid, list(range(start, start + n)), SamplingParams.greedy(max_tokens), (), params)


def run_step(s, token=1):
    out = s.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.sample}
    for r in s.update(out, sampled):
        s.finish(r, r.finish_reason)
    return out


def test_prefill_then_decode_within_budget():
    s, pool, _ = make()
    s.add(req("a", 10))
    out = run_step(s)
    assert [len(c.token_ids) for c in out.chunks] == [10] and out.chunks[0].sample
    out = run_step(s)
    assert out.chunks[0].token_ids == [1] and out.chunks[0].start_pos == 10


def test_chunked_prefill_splits_by_budget():
    s, _, _ = make(budget=4)
    s.add(req("a", 10))
    sizes = [len(run_step(s).chunks[0].token_ids) for _ in range(3)]
    assert sizes == [4, 4, 2]


def test_decode_and_prefill_share_a_step():
    s, _, _ = make(budget=16)
    s.add(req("a", 5))
    run_step(s)
    s.add(req("b", 20, start=100))
    out = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 15)]


def test_max_num_seqs_limits_running():
    s, _, _ = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 4, start=10 * i))
    out = run_step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_preemption_frees_blocks_and_recomputes():
    s, pool, _ = make(num_blocks=5, block_size=4, caching=False)
    s.add(req("a", 8, max_tokens=6))
    s.add(req("b", 8, max_tokens=6, start=50))
    run_step(s)  # each holds 2 blocks, one free
    assert pool.num_free == 1
    out = run_step(s)  # a takes the last block for its 9th token; b (newest) is preempted for its own
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    # a finishes; b is recomputed from scratch over prompt + its generated token
    while "a" in s.requests:
        run_step(s)
    out = run_step(s)
    assert out.chunks[0].request_id == "b" and len(out.chunks[0].token_ids) == 9


def test_request_larger_than_the_cache_finishes_with_length():
    s, pool, _ = make(num_blocks=3, block_size=4, caching=False)
    s.add(req("a", 8, max_tokens=20))
    outs = [run_step(s) for _ in range(6)]  # positions 0-7, then 8..12: the 13th token has nowhere to go
    out = outs[-1]
    assert all(not o.out_of_blocks for o in outs[:-1])
    assert [r.request_id for r in out.out_of_blocks] == ["a"] and out.chunks == []
    s.finish(out.out_of_blocks[0], "length")
    assert pool.num_free == 3


def test_prefix_hit_skips_cached_blocks():
    s, pool, _ = make(block_size=4)
    s.add(req("a", 10, max_tokens=1))
    run_step(s)  # a finishes; its 2 full blocks stay cached
    s.add(req("b", 10, max_tokens=1))
    out = run_step(s)
    assert out.chunks[0].start_pos == 8 and s.requests == {} and pool.num_free == pool.num_blocks


def test_full_prompt_hit_still_computes_last_token():
    s, _, _ = make(block_size=4)
    s.add(req("a", 8, max_tokens=1))
    run_step(s)
    s.add(req("b", 8, max_tokens=1))
    out = run_step(s)
    assert out.chunks[0].start_pos == 4 and len(out.chunks[0].token_ids) == 4


def test_remote_kv_parks_then_computes_last_token():
    s, pool, conn = make(block_size=4)
    s.add(req("d", 10, params=SOURCE))
    out = s.schedule()
    assert out.chunks == [] and s.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    rid, blocks, local, n = conn.allocated[0]
    assert (rid, len(blocks), local, n) == ("d", 3, 0, 10)
    s.on_kv_received("d")
    out = s.schedule()
    assert out.chunks[0].start_pos == 9 and out.chunks[0].token_ids == [9] and out.chunks[0].sample


def test_abort_while_waiting_for_kv_keeps_blocks_until_cancelled():
    s, pool, conn = make()
    s.add(req("d", 10, params=SOURCE))
    s.schedule()
    free_before = pool.num_free
    s.abort("d")
    assert conn.aborted == ["d"] and pool.num_free == free_before
    s.on_recv_cancelled("d")
    assert pool.num_free == pool.num_blocks


def test_prefill_side_pins_blocks_until_sent():
    s, pool, conn = make()
    s.add(req("p", 10, max_tokens=1, params=TO_DECODE))
    run_step(s)
    assert conn.finished == ["p"] and "p" in s.pinned and pool.num_free < pool.num_blocks
    s.on_send_finished("p")
    assert pool.num_free == pool.num_blocks


def test_prefill_aborted_queued_or_running_tells_the_connector():
    """A P request aborted before it finished has nothing to hand over: the connector hears of it (push: P
    refuses D's registration at once); blocks are freed, nothing is pinned."""
    s, pool, conn = make(budget=4)
    s.add(req("queued", 10, max_tokens=1, params=TO_DECODE))
    s.add(req("running", 10, max_tokens=1, start=50, params=TO_DECODE))
    s.abort("queued")
    run_step(s)  # "running" has its first 4 prompt tokens computed
    s.abort("running")
    assert conn.ended == ["queued", "running"] and conn.finished == [] and conn.aborted == []
    assert not s.pinned and pool.num_free == pool.num_blocks


def test_failed_recv_finishing_with_error_tells_the_connector():
    s, _, conn = make()
    s.add(req("d", 10, params=SOURCE))
    s.schedule()
    r = s.on_kv_failed("d", recompute=False)
    s.finish(r, "error", "KV transfer failed")
    assert conn.ended == ["d"] and conn.finished == []


def test_failed_recv_recompute_runs_locally():
    s, pool, _ = make()
    s.add(req("d", 10, params=SOURCE))
    s.schedule()
    assert s.on_kv_failed("d", recompute=True) is None
    out = s.schedule()
    assert out.chunks[0].start_pos == 0 and len(out.chunks[0].token_ids) == 10


def test_token_slice_matches_the_whole_list():
    r = req("x", 5)
    r.output_token_ids = [100, 101, 102]
    whole = r.all_token_ids
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 1):
            assert r.token_slice(a, b) == whole[a:b]


def test_abort_if_queued_spares_every_request_that_started():
    """--max-queue-wait-s: only a request that never left the waiting queue is aborted; one that computed (even
    if preempted back into the queue since) or parked for remote KV runs on."""
    s, pool, conn = make(num_blocks=64, budget=8, max_seqs=8)
    for r in (req("a", 20), req("b", 20, start=100), req("d", 11, params=SOURCE)):
        s.add(r)
    run_step(s)  # the budget of 8 goes to a's first chunk: b and d never left the queue
    assert s.abort_if_queued("a") is None and s.requests["a"].status is RequestStatus.RUNNING
    s._preempt(s.running.pop())  # a is back in the queue, but it started: not "queued" in this sense
    assert s.abort_if_queued("a") is None
    aborted = s.abort_if_queued("b")
    assert aborted is not None and aborted.finish_reason == "abort" and "b" not in s.requests
    assert conn.ended == ["b"]
    for _ in range(10):  # a runs again; once the budget reaches d, it parks for its remote KV
        run_step(s)
    assert s.requests["d"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.abort_if_queued("d") is None and s.abort_if_queued("nobody") is None


@pytest.mark.parametrize("cache_received_kv", [True, False])
def test_received_kv_enters_the_prefix_cache_only_when_proven(cache_received_kv: bool) -> None:
    """Without a deployment secret (cache_received_kv False) nothing proves that received KV is of the request's
    prompt: none of that request's blocks may serve a later request with the same prefix (issue 26)."""
    pool = BlockPool(64, True)
    s = Scheduler(SchedulerConfig(8, 64), pool, 4, 1024, RecordingConnector(4), cache_received_kv=cache_received_kv)
    s.add(req("d", 10, max_tokens=3, params=SOURCE))
    s.schedule()
    s.on_kv_received("d")
    while s.requests:
        run_step(s)
    s.add(req("b", 10, max_tokens=1))  # the same prompt, computed here
    out = run_step(s)
    assert out.chunks[0].start_pos == (8 if cache_received_kv else 0)
    assert pool.num_free == pool.num_blocks
