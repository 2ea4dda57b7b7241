"""The router's /kv_events follower (router/kv_stream.py) against a fake instance on loopback (aiohttp, one event
loop): the epoch is sent URL-encoded, an answer over the byte cap closes the stream, a snapshot with another hash
scheme stops the polls until the instance's epoch changes, and a snapshot is applied in full. Under a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from pdserve.kv.block_hashes import HASH_SCHEME
from pdserve.kv.events_wire import KVCacheSnapshot, KVEventsAnswer, encode_answer
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_stream import KVEventStreams, max_answer_bytes
from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import LegError, make_session

EPOCH = "e&1 x=2"  # needs URL-encoding
DEADLINE_S = 30.0


class FakeInstance:
    """GET /kv_events: a snapshot of `keys` to a poll without `after`, else no events after a short wait;
    GET /health: {"epoch": epoch}. Counts both."""

    def __init__(self, keys: list[bytes], scheme: dict[str, Any] = HASH_SCHEME) -> None:
        self.keys, self.scheme, self.epoch = keys, scheme, EPOCH
        self.queries: list[dict[str, str]] = []  # every /kv_events poll's query
        self.num_health = 0  # /health GETs
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def kv_events(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        if "after" not in request.query:
            snap = KVCacheSnapshot("first", 16, True, self.scheme, self.keys)
            return web.json_response(encode_answer(KVEventsAnswer(self.epoch, 0, snap)))
        await asyncio.sleep(0.05)
        return web.json_response(encode_answer(KVEventsAnswer(self.epoch, 0)))

    async def health(self, request: web.Request) -> web.Response:
        self.num_health += 1
        return web.json_response({"status": "ok", "epoch": self.epoch})

    async def __aenter__(self) -> FakeInstance:
        app = web.Application()
        app.router.add_get("/kv_events", self.kv_events)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(n)]


async def until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:.0f} s: {what}"
        await asyncio.sleep(0.01)


def run(case: Callable[[FakeInstance, KVEventStreams], Awaitable[None]], fake_keys: list[bytes], max_keys: int,
        scheme: dict[str, Any] = HASH_SCHEME) -> None:  # fmt: skip
    async def main() -> None:
        async with FakeInstance(fake_keys, scheme) as fake:
            session = make_session(5.0)
            try:
                index = KVIndex([fake.url], max_keys)
                await case(fake, KVEventStreams(index, session, RouterMetrics(), wait_s=0.1, backoff_s=0.01,
                                                max_backoff_s=0.02))  # fmt: skip
            finally:
                await session.close()

    asyncio.run(main())


def test_the_epoch_is_url_encoded_and_a_snapshot_is_applied_whole() -> None:
    async def case(fake: FakeInstance, streams: KVEventStreams) -> None:
        await streams.poll_once(fake.url)
        inst = streams.index.instances[fake.url]
        assert inst.usable and inst.epoch == EPOCH and inst.num_keys == 5000
        await streams.poll_once(fake.url)  # after=0&epoch=...
        assert fake.queries[1] == {"wait_s": "0.1", "after": "0", "epoch": EPOCH}
        assert inst.usable and inst.num_keys == 5000

    run(case, keys(5000), max_keys=10_000)


def test_an_answer_over_the_byte_cap_closes_the_stream() -> None:
    """The cap is max_answer_bytes(max_keys): 4 x 40 bytes per key + 1 MiB; 40k keys are ~1.5 MB of JSON."""

    async def case(fake: FakeInstance, streams: KVEventStreams) -> None:
        assert streams.max_answer_bytes == max_answer_bytes(10) < 40_000 * 36
        with pytest.raises(LegError, match="longer than"):
            await streams.poll_once(fake.url)
        assert not streams.index.instances[fake.url].usable

    run(case, keys(40_000), max_keys=10)


def test_another_hash_scheme_stops_the_polls_until_the_epoch_changes() -> None:
    async def case(fake: FakeInstance, streams: KVEventStreams) -> None:
        state = streams.metrics.streams[fake.url]
        streams.start()
        try:
            await until("the scheme was refused and /health asked 3 times", lambda: fake.num_health >= 3)
            assert len(fake.queries) == 1 and state.num_failures == 1 and not state.up
            fake.epoch, fake.scheme = "restarted", HASH_SCHEME  # the instance restarts with our scheme
            await until("followed again", lambda: state.up)
            assert streams.index.instances[fake.url].usable
        finally:
            await streams.stop()

    run(case, keys(3), max_keys=100, scheme={**HASH_SCHEME, "name": "sha256-chain"})
