"""The scheduler's admission counts (engine/admissions.py, /metrics' pdserve_prompt_tokens_total and
pdserve_prefix_cache_hit_tokens_total): each request once, its own prefix-cache hits only (no torch)."""

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.params import PullSource, PushSource
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.nop import NopScheduler

SOURCE = PullSource("127.0.0.1", 5600, None, "p-1", (0, 1, 2), 10, 4)  # D: the prompt's KV comes from a prefill


class RemoteWhenSourced(NopScheduler):
    """A request carrying a prefill's coordinates waits for its remote KV (as the pull/push schedulers decide)."""

    def needs_remote_kv(self, request_id, params):
        return isinstance(params, PullSource | PushSource)

    def on_blocks_allocated(self, *args, **kwargs):
        pass  # the KV is "in flight" until the test calls on_kv_received or on_kv_failed


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 64) -> Scheduler:
    pool = BlockPool(num_blocks, True)
    return Scheduler(SchedulerConfig(8, budget), pool, block_size, 1024, RemoteWhenSourced(block_size))


def request(rid: str, n: int, start: int = 0, max_tokens: int = 1, params: PullSource | None = None) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams.greedy(max_tokens), (), params)


def run_to_end(s: Scheduler) -> None:
    for _ in range(100):
        if not s.requests:
            return
        out = s.schedule()
        for r in s.update(out, {c.request_id: 1 for c in out.chunks if c.sample}):
            s.finish(r, r.finish_reason or "stop")
    raise AssertionError(f"requests left: {list(s.requests)}")


def counts(s: Scheduler) -> tuple[int, int, int]:
    return s.admitted.num_requests, s.admitted.num_prompt_tokens, s.admitted.num_prefix_hit_tokens


def test_a_repeated_prompt_counts_its_cached_blocks_as_hits() -> None:
    s = make()
    s.add(request("a", 10))
    run_to_end(s)
    assert counts(s) == (1, 10, 0)
    s.add(request("b", 10))  # the same prompt: 2 full blocks cached (a hit never covers the last token)
    s.add(request("c", 9, start=100))  # another prompt: no hit
    run_to_end(s)
    assert counts(s) == (3, 29, 8)


def test_a_preempted_request_is_counted_once() -> None:
    s = make(num_blocks=5, budget=64)
    s.add(request("a", 8, max_tokens=6))
    s.add(request("b", 8, start=50, max_tokens=6))
    out = s.schedule()
    s.update(out, {c.request_id: 1 for c in out.chunks})
    out = s.schedule()  # a needs a third block: b (newest) is preempted, to be recomputed later
    assert out.preempted_ids == ["b"]
    s.update(out, {c.request_id: 1 for c in out.chunks})
    run_to_end(s)  # b is recomputed (its hits taken again, none: caching is per full block): not counted again
    assert counts(s) == (2, 16, 0)


def test_a_decode_parked_for_remote_kv_counts_only_its_own_prefix() -> None:
    s = make()
    s.add(request("local", 10))
    run_to_end(s)  # D computed this prompt itself once: 2 full blocks cached
    s.add(request("d", 10, params=SOURCE))
    s.schedule()  # parked: its own 8 cached tokens are hits, the rest comes from the prefill
    assert counts(s) == (2, 20, 8)
    s.on_kv_received("d")
    run_to_end(s)  # the received KV is not a hit, and the landed request is not counted again
    assert counts(s) == (2, 20, 8)
    s.add(request("e", 13, start=200, params=SOURCE))  # nothing cached: all of it received
    s.schedule()
    assert s.on_kv_failed("e", recompute=True) is None  # recomputed here: still counted once
    run_to_end(s)
    assert counts(s) == (3, 33, 8)
