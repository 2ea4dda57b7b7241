"""The router's view of its backends' health: a background task polls every instance's GET /health.

An instance that does not answer 200 within the timeout is marked unhealthy: `Pool.choose()` routes around it
until a later check answers 200 again (then it takes traffic at once). A pull router refuses a request with
503 before running its prefill leg when no decode instance is healthy. An instance whose /health reports a new
process epoch has restarted: `on_restart(url)` drops what the router cached about it (P's /kv_transfer/info),
so the next request uses the new process's coordinates instead of failing once on the old ones. An instance
whose /health names the packed-prompt version it reads (prompt_pack.HEALTH_KEY) gets token ids packed from then on.

Owner: the router app's lifespan starts the task and cancels it at shutdown (`start()` / `stop()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from pdserve import prompt_pack
from pdserve.router.policy import Backend, Pool
from pdserve.router.upstream import LegError, get_json

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        pools: list[Pool],
        session: aiohttp.ClientSession,
        interval_s: float,
        timeout_s: float,
        on_restart: Callable[[str], None] = lambda url: None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("health interval and timeout must be > 0")
        self.pools = pools
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_restart = on_restart
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check_pool(self, pool: Pool) -> None:
        """Check `pool`'s instances now (before a refusal based on marks up to one interval old)."""
        await asyncio.gather(*(self.check(pool, b) for b in pool.backends))

    async def check_all(self) -> None:
        backends = {b.url: (pool, b) for pool in self.pools for b in pool.backends}
        await asyncio.gather(*(self.check(pool, b) for pool, b in backends.values()))

    async def check(self, pool: Pool, backend: Backend) -> None:
        try:
            answer = await get_json(self.session, pool.role, backend.url, "/health", self.timeout_s)
        except LegError as e:
            if backend.healthy:
                log.warning("%s instance %s is unhealthy, routing around it: %s", pool.role, backend.url, e)
            backend.healthy = False
            return
        if not backend.healthy:
            log.info("%s instance %s is healthy again", pool.role, backend.url)
        backend.healthy = True
        epoch = answer.get("epoch") if isinstance(answer, dict) else None
        packed = answer.get(prompt_pack.HEALTH_KEY) if isinstance(answer, dict) else None
        backend.packed_ids = packed if type(packed) is int else None  # a vLLM instance: JSON lists
        if isinstance(epoch, str):
            if backend.epoch is not None and epoch != backend.epoch:
                log.info("%s instance %s restarted (epoch %s -> %s)", pool.role, backend.url, backend.epoch, epoch)
                self.on_restart(backend.url)
            backend.epoch = epoch

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the monitor die: the next round tries again
                log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)
