"""The prefix cache's event log (engine/kv_events.py) and its wire format (kv/events_wire.py): order and sequence
numbers, a reader that falls behind the ring sees a gap and resyncs from a snapshot, and snapshot + events always
rebuild the block pool's own set of cached keys, driven by the scheduler and by random pool churn (no torch)."""

from __future__ import annotations

import random

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_events import REMOVED, STORED, KVEventLog, KVEvents
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.block_hashes import HASH_SCHEME, hash_block, prompt_block_hashes
from pdserve.kv.events_wire import KVCacheSnapshot, KVEventsAnswer, decode_answer, encode_answer, runs
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.nop import NopScheduler

K = [bytes([i]) * 16 for i in range(16)]  # distinct keys


class Consumer:
    """What a router does with the log: a set rebuilt from a snapshot and the events after it."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.keys: set[bytes] = set()
        self.seq = -1
        self.num_resyncs = 0

    def sync(self) -> None:
        events = self.log.read(self.seq) if self.seq >= 0 else None
        if events is None:
            snap = self.log.snapshot()
            self.keys, self.seq = set(snap.keys), snap.seq
            self.num_resyncs += 1
            return
        assert events.after == self.seq and len(events.keys) == events.seq - self.seq
        for kind, key in zip(events.kinds, events.keys, strict=True):
            if kind == STORED:
                assert key not in self.keys  # a key alternates stored, removed
                self.keys.add(key)
            else:
                self.keys.remove(key)
        self.seq = events.seq


def cached_keys(pool: BlockPool) -> set[bytes]:
    return set(pool._cached)


def test_events_come_in_order_with_consecutive_seqs() -> None:
    log = KVEventLog(capacity=8)
    assert log.seq == 0 and log.read(0) == KVEvents(0, 0, b"", [])
    log.stored(K[1])
    log.stored(K[2])
    log.removed(K[1])
    log.stored(K[1])
    assert log.seq == 4
    ev = log.read(0)
    assert ev is not None and (ev.after, ev.seq) == (0, 4)
    assert list(ev.kinds) == [STORED, STORED, REMOVED, STORED] and ev.keys == [K[1], K[2], K[1], K[1]]
    tail = log.read(2)
    assert tail is not None and list(tail.kinds) == [REMOVED, STORED] and tail.keys == [K[1], K[1]]
    assert log.read(4) == KVEvents(4, 4, b"", [])
    assert log.read(5) is None  # a seq this log never issued
    assert sorted(log.snapshot().keys) == [K[1], K[2]] and log.snapshot().seq == 4


def test_a_reader_behind_the_ring_sees_a_gap_and_resyncs() -> None:
    log = KVEventLog(capacity=4)
    for i in range(10):  # wraps the ring twice and a half
        log.stored(K[i])
    assert log.read(5) is None  # events 6..10 are 5 > capacity
    ev = log.read(6)  # 7..10: exactly the ring
    assert ev is not None and ev.keys == [K[6], K[7], K[8], K[9]] and ev.seq == 10
    snap = log.snapshot()
    assert snap.seq == 10 and set(snap.keys) == set(K[:10])
    log.removed(K[0])
    after = log.read(snap.seq)
    assert after is not None and after.keys == [K[0]] and list(after.kinds) == [REMOVED]


def test_restart_starts_from_the_pools_keys_and_invalidates_older_seqs() -> None:
    log = KVEventLog()
    log.stored(K[1])
    log.restart([K[5]])
    assert log.read(0) is None and log.read(1) is not None  # numbering goes on; older seqs resync
    assert log.snapshot().keys == [K[5]] and log.snapshot().seq == 1


@pytest.mark.parametrize("capacity", [1 << 12, 8])
def test_random_pool_churn_snapshot_and_events_rebuild_the_pools_set(capacity: int) -> None:
    """Allocations that evict, caches, frees, in random order, the log attached mid-life (it starts from the keys
    cached then), a reader polling at random moments: with a large ring it never resyncs after its first snapshot,
    with a small one it resyncs on gaps; it always holds exactly the pool's keys."""
    rng = random.Random(0)
    pool = BlockPool(48)
    log = KVEventLog(capacity)
    reader = Consumer(log)
    held: list[list[int]] = []
    parent = None
    for step in range(3000):
        if step == 500:
            pool.record_events(log)
        op = rng.random()
        if op < 0.45 and pool.num_free >= 4:
            blocks = pool.allocate(rng.randint(1, 4))
            for b in blocks:
                parent = hash_block(parent if rng.random() < 0.7 else None, [rng.randint(0, 50)])
                pool.cache(b, parent)
            held.append(blocks)
        elif held:
            pool.free(reversed(held.pop(rng.randrange(len(held)))))
        if step >= 500 and rng.random() < 0.3:
            reader.sync()
            assert reader.keys == cached_keys(pool)
    reader.sync()
    assert reader.keys == cached_keys(pool)
    assert log.seq > 1000  # the churn evicted: many stores and removals
    assert (reader.num_resyncs == 1) == (capacity > 8)


def test_scheduler_prefix_hits_are_not_stored_twice_and_evictions_are_removed() -> None:
    """Two prompts sharing two blocks through the real scheduler: the first stores its full blocks, the second
    only the blocks after the shared prefix (its hits are already cached); a third, larger request evicts."""
    bs = 4
    pool = BlockPool(12)
    log = KVEventLog()
    pool.record_events(log)
    s = Scheduler(SchedulerConfig(8, 64), pool, bs, 1024, NopScheduler(bs))

    def run(rid: str, prompt: list[int]) -> None:
        s.add(Request(rid, prompt, SamplingParams.greedy(1), ()))
        while s.has_work():
            out = s.schedule()
            for r in s.update(out, {c.request_id: 0 for c in out.chunks if c.sample}):
                s.finish(r, r.finish_reason)

    a = list(range(100, 114))  # 3 full blocks + 2 tokens
    b = a[:8] + list(range(200, 210))  # shares 2 blocks, then 2 full blocks of its own + 2 tokens
    run("a", a)
    ev = log.read(0)
    assert ev is not None and set(ev.kinds) == {STORED} and ev.keys == prompt_block_hashes(a, bs)
    run("b", b)
    ev = log.read(ev.seq)
    assert ev is not None and set(ev.kinds) == {STORED} and ev.keys == prompt_block_hashes(b, bs)[2:]
    assert set(log.snapshot().keys) == set(prompt_block_hashes(a, bs)) | set(prompt_block_hashes(b, bs))
    run("c", list(range(300, 340)))  # 10 blocks of 12: evicts the least recently freed
    ev = log.read(ev.seq)
    assert ev is not None and REMOVED in ev.kinds
    assert set(log.snapshot().keys) == cached_keys(pool)


def test_prefix_caching_off_records_nothing() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    log = KVEventLog()
    pool.record_events(log)
    pool.cache(pool.allocate(1)[0], K[1])
    assert log.seq == 0 and log.snapshot().keys == []


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=0)


# ---- the wire format ------------------------------------------------------------------------------------------


def test_wire_round_trip_of_events_and_snapshot() -> None:
    kinds = bytes([STORED, STORED, REMOVED, STORED])
    events = runs(kinds, [K[1], K[2], K[1], K[3]])
    assert events == [(True, [K[1], K[2]]), (False, [K[1]]), (True, [K[3]])]
    body = encode_answer(KVEventsAnswer("ep", 14, None, events))
    assert body["events"][0] == ["stored", [K[1].hex(), K[2].hex()]] and body["snapshot"] is None
    assert decode_answer(body, after=10) == KVEventsAnswer("ep", 14, None, events)
    snap = KVCacheSnapshot("first", 16, True, HASH_SCHEME, [K[4], b"\x01\x00" + K[5]])
    body = encode_answer(KVEventsAnswer("ep", 3, snap))
    assert body["snapshot"]["block_hashes"] == [K[4].hex(), "0100" + K[5].hex()]
    assert decode_answer(body) == KVEventsAnswer("ep", 3, snap)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "version"),
        ({"epoch": ""}, "epoch"),
        ({"seq": -1}, "seq"),
        ({"seq": True}, "seq"),
        ({"events": {}}, "events must be a list"),
        ({"events": [["added", []]]}, "events\\[0\\]"),
        ({"events": [["stored", ["zz"]]]}, "events\\[0\\]"),
        ({"events": [["stored", [K[1].hex()]]]}, "1 events from seq 10 to 12"),
        ({"snapshot": []}, "snapshot must be"),
        ({"snapshot": {"reason": "why", "prefix_caching": True, "hash": {}, "block_size": 4}}, "reason"),
        ({"snapshot": {"reason": "gap", "prefix_caching": 1, "hash": {}, "block_size": 4}}, "prefix_caching"),
        ({"snapshot": {"reason": "gap", "prefix_caching": True, "hash": {}, "block_size": 0}}, "block_size"),
    ],
)
def test_decode_refuses_a_malformed_answer_naming_the_field(change: dict, message: str) -> None:
    body = {"version": 1, "epoch": "ep", "seq": 12, "snapshot": None, "events": []} | change
    with pytest.raises(ValueError, match=message):
        decode_answer(body, after=10 if "seq" not in change else None)
