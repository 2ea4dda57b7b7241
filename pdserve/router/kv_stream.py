"""Following every instance's GET /kv_events (a long poll, kv/events_wire.py) into the router's prefix index.

One task per instance URL, on the router's event loop. Each poll sends the index's `after` and `epoch` (none
until the first snapshot) and applies the answer (router/kv_index.py). A poll that fails — the instance is down,
silent past wait_s + SILENT_MARGIN_S, answers an error (401: the router lacks the internal credential; 404: not a
pdserve instance), or answers something malformed or inapplicable (a gap it did not mark, another hash scheme)
— closes that stream only: the instance's index is reset (scored as empty, so it is chosen by load alone), the
loss is logged once and shown in /metrics (`pdserve_router_kv_stream_up` 0), and the task polls again from a
snapshot after a backoff (BACKOFF_S doubling to MAX_BACKOFF_S). Routing never waits for a stream.

Owner: the router app's lifespan starts the tasks (`start()`) and cancels them at shutdown (`stop()`), before
the HTTP session closes. Started only with `--routing kv-aware`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from pdserve.kv.events_wire import decode_answer
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics, StreamState
from pdserve.router.upstream import LegError, get_json

log = logging.getLogger(__name__)

WAIT_S = 2.0  # each poll's wait_s: an idle instance answers this often (the server allows up to 4)
SILENT_MARGIN_S = 10.0  # an instance that has not answered wait_s + this is silent (a loaded host is slow)
BACKOFF_S = 0.5  # the first retry after a failed poll
MAX_BACKOFF_S = 16.0  # retries of a stream that keeps failing come at most this far apart


class KVEventStreams:
    """The tasks that keep `index` in step with its instances' caches."""

    def __init__(
        self,
        index: KVIndex,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        wait_s: float = WAIT_S,
        silent_margin_s: float = SILENT_MARGIN_S,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        if wait_s < 0 or silent_margin_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("kv event stream timings must be positive (and max backoff >= backoff)")
        self.index = index
        self.session = session  # carries the router's upstream key (the internal credential when it has one)
        self.metrics = metrics
        self.wait_s = wait_s
        self.timeout_s = wait_s + silent_margin_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._tasks: list[asyncio.Task[None]] = []
        for url in index.instances:
            metrics.streams[url] = StreamState()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(url), name=f"kv-events {url}") for url in self.index.instances]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def poll_once(self, url: str) -> None:
        """One poll of `url`'s /kv_events applied to its index; raises LegError or ValueError (KVIndexError)."""
        inst = self.index.instances[url]
        after = inst.seq
        query = f"?wait_s={self.wait_s:g}"
        if after is not None:
            query += f"&after={after}&epoch={inst.epoch}"
        body = await get_json(self.session, "kv-events", url, "/kv_events" + query, self.timeout_s)
        answer = decode_answer(body, after)
        self.index.apply(url, answer)
        state = self.metrics.streams[url]
        if answer.snapshot is not None:
            state.num_snapshots += 1
            if answer.snapshot.reason != "first" or state.num_snapshots > 1:
                log.info(
                    "kv events of %s: resynced from a snapshot (%s, %d keys, epoch %s)",
                    url, answer.snapshot.reason, len(answer.snapshot.keys), answer.epoch,
                )  # fmt: skip

    async def _follow(self, url: str) -> None:
        state = self.metrics.streams[url]
        backoff = self.backoff_s
        while True:
            try:
                await self.poll_once(url)
            except (LegError, ValueError) as e:
                self.index.instances[url].reset()
                state.num_failures += 1
                if state.up or state.last_error is None:
                    log.warning(
                        "kv events of %s lost, routing to it by load only until they resume: %s", url, e
                    )  # once per loss; the next success logs the recovery
                state.up, state.last_error = False, str(e)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.max_backoff_s)
                continue
            except Exception:  # never let a stream's task die: the next poll starts over from a snapshot
                log.exception("kv events of %s: unexpected failure", url)
                self.index.instances[url].reset()
                state.up, state.last_error = False, "unexpected failure"
                await asyncio.sleep(self.max_backoff_s)
                continue
            if not state.up:
                inst = self.index.instances[url]
                log.info(
                    "kv events of %s followed: epoch %s, block size %s, %d keys",
                    url, inst.epoch, inst.block_size, inst.num_keys,
                )  # fmt: skip
            state.up = True
            backoff = self.backoff_s
