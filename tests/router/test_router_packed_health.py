"""Which instances the router sends packed token ids (prompt_pack.py): those whose GET /health names the version it
writes, read at every health check (router/health.py). A stand-in for a foreign instance on loopback (aiohttp)
answers /health as vLLM does (200, an empty body) or with a given JSON object. Under a second."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pdserve import prompt_pack
from pdserve.router.call import reads_packed
from pdserve.router.health import HealthMonitor
from pdserve.router.policy import Backend, Pool
from pdserve.router.upstream import make_session


async def _checked_after(answers: list[Any]) -> list[int | None]:
    """The backend's packed_ids after each health check, the instance answering `answers` in turn (None: an empty
    200 body, as vLLM's /health)."""
    turn = {"i": 0}

    async def health(request: web.Request) -> web.Response:
        answer = answers[turn["i"]]
        return web.Response(status=200) if answer is None else web.json_response(answer)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    seen = []
    try:
        async with make_session(5.0) as session:
            pool = Pool("decode", [url])
            monitor = HealthMonitor([pool], session, 1.0, 10.0)
            for i in range(len(answers)):
                turn["i"] = i
                await monitor.check(pool, pool.backends[0])
                assert pool.backends[0].healthy
                seen.append(pool.backends[0].packed_ids)
    finally:
        await runner.cleanup()
    return seen


def test_only_instances_that_name_the_version_get_packed_ids() -> None:
    key, version = prompt_pack.HEALTH_KEY, prompt_pack.VERSION
    answers = [
        None,  # vLLM
        {"status": "ok", "epoch": "a", key: version},  # pdserve
        {"status": "ok", "epoch": "a", key: str(version)},  # not an int: JSON lists
        {"status": "ok", "epoch": "a", key: True},
        {"status": "ok", "epoch": "b", key: version + 1},  # a version this router does not write
        {"status": "ok", "epoch": "c"},  # a pdserve from before the packed form
        {"status": "ok", "epoch": "d", key: version},
        None,  # the port now serves vLLM: back to JSON lists at once
    ]
    seen = asyncio.run(_checked_after(answers))
    assert seen == [None, version, None, None, version + 1, None, version, None]
    packed = [reads_packed(Backend("u", packed_ids=v)) for v in seen]
    assert packed == [False, True, False, False, False, False, True, False]
