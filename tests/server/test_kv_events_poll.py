"""GET /kv_events' query and long poll (server/kv_events.py) over a real event log, without HTTP: which answer
comes when (snapshot on first poll, on another epoch, on a gap; events as soon as there are some; an empty
answer after wait_s), and every 400 names its parameter. The route through HTTP, with keys: tests/e2e."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.engine.client import EngineInfo
from pdserve.engine.kv_events import KVEventLog
from pdserve.kv.block_hashes import HASH_SCHEME
from pdserve.kv.events_wire import decode_answer
from pdserve.server.kv_events import MAX_WAIT_S, KVEventsQuery, parse_query, poll
from pdserve.server.protocol import ApiError

INFO = EngineInfo("m", "m", 64, 100, 32, 4, {})
K = [bytes([i]) * 16 for i in range(10)]


def run_poll(log: KVEventLog, after: int | None, epoch: str | None = "E", wait_s: float = 0.0) -> dict:
    body = asyncio.run(poll("E", INFO, log, KVEventsQuery(after, None if after is None else epoch, wait_s)))
    return json.loads(body)


def test_first_poll_is_a_snapshot_with_the_hash_scheme() -> None:
    log = KVEventLog()
    log.stored(K[1])
    log.stored(K[2])
    answer = decode_answer(run_poll(log, None))
    assert answer.epoch == "E" and answer.seq == 2 and answer.events == []
    snap = answer.snapshot
    assert snap is not None and snap.reason == "first" and sorted(snap.keys) == [K[1], K[2]]
    assert (snap.block_size, snap.prefix_caching, snap.hash_scheme) == (4, True, HASH_SCHEME)


def test_events_after_a_seq_then_another_epoch_and_a_gap_resync() -> None:
    log = KVEventLog(capacity=4)
    log.stored(K[1])
    log.stored(K[2])
    log.removed(K[1])
    answer = decode_answer(run_poll(log, 1), after=1)
    assert answer.snapshot is None and answer.seq == 3 and answer.events == [(True, [K[2]]), (False, [K[1]])]
    other = decode_answer(run_poll(log, 1, epoch="before-restart"))
    assert other.snapshot is not None and other.snapshot.reason == "epoch" and other.snapshot.keys == [K[2]]
    for i in range(3, 9):
        log.stored(K[i])
    gap = decode_answer(run_poll(log, 3))
    assert gap.snapshot is not None and gap.snapshot.reason == "gap" and gap.seq == 9
    assert decode_answer(run_poll(log, 99)).snapshot is not None  # a seq this log never issued


def test_a_poll_waits_for_events_and_answers_empty_after_wait_s() -> None:
    log = KVEventLog()

    async def later() -> dict:
        task = asyncio.create_task(poll("E", INFO, log, KVEventsQuery(0, "E", 2.0)))
        await asyncio.sleep(0.1)
        log.stored(K[3])  # (the engine thread, in production)
        return json.loads(await task)

    started = time.monotonic()
    answer = decode_answer(asyncio.run(later()), after=0)
    assert answer.events == [(True, [K[3]])] and time.monotonic() - started < 1.0
    started = time.monotonic()
    empty = decode_answer(run_poll(log, 1, wait_s=0.2), after=1)
    assert empty.events == [] and empty.seq == 1 and 0.2 <= time.monotonic() - started < 1.0


def test_query_defaults_and_refusals_name_the_parameter() -> None:
    assert parse_query({}) == KVEventsQuery(None, None, 1.0)
    assert parse_query({"after": "7", "epoch": "x", "wait_s": "0"}) == KVEventsQuery(7, "x", 0.0)
    bad = [
        ({"after": "-1", "epoch": "x"}, "after"),
        ({"after": "1.5", "epoch": "x"}, "after"),
        ({"after": "1" * 20, "epoch": "x"}, "after"),
        ({"after": "3"}, "after and epoch"),
        ({"epoch": "x"}, "after and epoch"),
        ({"wait_s": "nan"}, "wait_s"),
        ({"wait_s": "-1"}, "wait_s"),
        ({"wait_s": str(MAX_WAIT_S + 1)}, "wait_s"),
        ({"wait_s": "soon"}, "wait_s"),
    ]
    for params, name in bad:
        with pytest.raises(ApiError, match=name) as e:
            parse_query(params)
        assert e.value.status == 400
