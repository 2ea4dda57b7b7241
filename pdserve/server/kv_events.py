"""GET /kv_events?after=SEQ&epoch=E&wait_s=S: a long poll over the instance's prefix-cache event log.

The answer (kv/events_wire.py) is a snapshot when `after` is absent, names another epoch, or is older than the
log holds (a gap); otherwise the events after `after` once there are some, looked for POLL_S after the poll
arrives and every POLL_S from then (so a consumer polling with wait_s >= POLL_S gets at most 1 / POLL_S answers a
second however busy the cache, each holding every event since its last), or none after `wait_s` (the keepalive:
an instance that does not answer within wait_s plus a margin is silent).

Why a long poll and not a stream (SSE or NDJSON): every answer is one complete JSON document, so a consumer (the
router, an aiohttp client) never holds a half-read stream or parses partial lines, and a dropped connection is
just the next poll, which resumes from `after` without a snapshot; the key is checked on every poll (web.protect);
and no response is open-ended, so a stopping server is held for at most wait_s (MAX_WAIT_S is under uvicorn's
5-s graceful shutdown) instead of cutting streams with an error. The price is one HTTP request per poll: ~20 a
second per consumer while the cache changes, one per wait_s while it does not.

The handler reads the log only (engine/kv_events.py), never the engine. A snapshot is encoded and rendered in a
worker thread, off the event loop (100k keys, 3.6 MB of JSON: 30 ms of hex and 34 ms of json.dumps on the 2-core
development machine).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from pdserve.engine.client import EngineInfo
from pdserve.engine.kv_events import KVEventLog
from pdserve.kv.block_hashes import HASH_SCHEME
from pdserve.kv.events_wire import KVCacheSnapshot, KVEventsAnswer, encode_answer, runs
from pdserve.server.protocol import ApiError

POLL_S = 0.05  # how often a waiting poll looks at the log's seq
DEFAULT_WAIT_S = 1.0  # a poll with nothing new is answered (empty) after this long
MAX_WAIT_S = 4.0  # the longest wait_s a poll may ask for (under uvicorn's timeout_graceful_shutdown, 5 s)


@dataclass(frozen=True)
class KVEventsQuery:
    """The query of one poll, validated."""

    after: int | None  # the seq the consumer has (None: it has nothing, send a snapshot)
    epoch: str | None  # the epoch that seq is of (required with after: seqs restart with the instance)
    wait_s: float  # how long to wait for events before answering with none


def parse_query(params: Mapping[str, str]) -> KVEventsQuery:
    """Raises ApiError(400) naming the bad parameter."""
    after: int | None = None
    if (raw := params.get("after")) is not None:
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
            raise ApiError(400, f"after must be a non-negative integer (a seq from an earlier answer), got {raw!r}")
        after = int(raw)
    epoch = params.get("epoch")
    if (after is None) != (epoch is None):
        raise ApiError(400, "give after and epoch together (the seq and epoch of the previous answer), or neither")
    wait_s = DEFAULT_WAIT_S
    if (raw := params.get("wait_s")) is not None:
        try:
            wait_s = float(raw)
        except ValueError:
            wait_s = math.nan
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ApiError(400, f"wait_s must be a number of seconds in [0, {MAX_WAIT_S}], got {raw!r}")
    return KVEventsQuery(after, epoch, wait_s)


async def poll(epoch: str, info: EngineInfo, log: KVEventLog, query: KVEventsQuery) -> bytes:
    """The answer as a JSON document: a snapshot, the events after query.after, or none after query.wait_s."""
    if query.after is None or query.epoch != epoch:
        return await _snapshot(epoch, info, log, "first" if query.after is None else "epoch")
    deadline = time.monotonic() + query.wait_s
    await asyncio.sleep(min(POLL_S, query.wait_s))  # events batch up: a consumer's answers come POLL_S apart
    while log.seq == query.after and time.monotonic() < deadline:
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    events = log.read(query.after)
    if events is None:  # older than the ring holds, or not a seq of this log
        return await _snapshot(epoch, info, log, "gap")
    return _render(KVEventsAnswer(epoch, events.seq, None, runs(events.kinds, events.keys)))


async def _snapshot(epoch: str, info: EngineInfo, log: KVEventLog, reason: str) -> bytes:
    snap = log.snapshot()
    cache = KVCacheSnapshot(reason, info.block_size, info.prefix_caching, HASH_SCHEME, snap.keys)
    return await run_in_threadpool(_render, KVEventsAnswer(epoch, snap.seq, cache))


def _render(answer: KVEventsAnswer) -> bytes:
    return json.dumps(encode_answer(answer), separators=(",", ":")).encode()
