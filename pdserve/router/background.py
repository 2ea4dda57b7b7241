"""The router's work that outlives a client's answer: releases of KV that a decode leg will never take, and
prefill legs still finishing after D answered. Each is a task held here until it ends (so none is collected
mid-flight) and whose failure is logged, never raised at the client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from pdserve.router.call import Call
from pdserve.router.upstream import LegError, post_json

log = logging.getLogger(__name__)


class Background:
    """Tasks of finished calls, one set for the router's life."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._tasks: set[asyncio.Task[Any]] = set()

    def release_on(self, p_url: str, which: dict[str, Any], call: Call) -> None:
        """Tell P to free the KV it pinned for a decode leg that will never take it (POST /kv_transfer/release
        with the request's id and capability; 404 = already gone, which is fine; 403 = P never accepted that
        capability, a restarted P: nothing of it is pinned)."""
        name = {k: v for k, v in which.items() if k != "kv_transfer_params"}

        async def release() -> None:
            try:
                await post_json(self.session, "prefill", p_url, "/kv_transfer/release", which, call.headers)
            except LegError as e:
                if e.status == 403:
                    log.info("request %s: %s refused the release of %s: %s", call.request_id, p_url, name, e)
                elif e.status != 404:
                    log.warning("request %s: releasing %s on %s failed: %s", call.request_id, name, p_url, e)

        self._hold(asyncio.create_task(release()))

    def finish(self, task: asyncio.Task[Any], call: Call) -> None:
        """Let a P leg that is still answering finish on its own, logging a failure."""

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("request %s: prefill leg failed after decode answered: %s", call.request_id, t.exception())

        if task.done():
            done(task)
        else:
            self._tasks.add(task)
            task.add_done_callback(done)

    def _hold(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
