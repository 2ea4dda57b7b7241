"""Following every instance's GET /kv_events (a long poll, kv/events_wire.py) into the router's prefix index.

One task per instance URL, on the router's event loop. Each poll sends the index's `after` and `epoch` (none
until the first snapshot) and applies the answer (router/kv_index.py). A poll that fails — the instance is down,
silent past wait_s + SILENT_MARGIN_S, answers an error (401: the router lacks the internal credential; 404: not a
pdserve instance), or answers something malformed or inapplicable (a gap it did not mark, another hash scheme)
— closes that stream only: the instance's index is reset (scored as empty, so it is chosen by load alone), the
loss is logged once and shown in /metrics (`pdserve_router_kv_stream_up` 0), and the task polls again from a
snapshot after a backoff (BACKOFF_S doubling to MAX_BACKOFF_S). Routing never waits for a stream.

An answer is read up to `max_answer_bytes` (over it: malformed, the stream closes) and parsed, decoded and, for
a snapshot, built into the index's key set in a worker thread (a 262k-key snapshot took ~1.1-1.7 s on the
event loop); only the swap and event runs (one poll's worth) are applied on the loop. A snapshot hashed with
another scheme is logged as an error once and that instance is not polled again until its /health reports
another epoch (checked every MAX_BACKOFF_S): every snapshot it sends would be refused the same way.

Owner: the router app's lifespan starts the tasks (`start()`) and cancels them at shutdown (`stop()`), before
the HTTP session closes. Started only with `--routing kv-aware`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp

from pdserve.kv.events_wire import KVEventsAnswer, decode_answer
from pdserve.router.kv_index import HashSchemeError, KVIndex, SnapshotKeys, snapshot_keys
from pdserve.router.metrics import RouterMetrics, StreamState
from pdserve.router.upstream import LegError, get_bytes, get_json

log = logging.getLogger(__name__)

WAIT_S = 2.0  # each poll's wait_s: an idle instance answers this often (the server allows up to 4)
SILENT_MARGIN_S = 10.0  # an instance that has not answered wait_s + this is silent (a loaded host is slow)
BACKOFF_S = 0.5  # the first retry after a failed poll
MAX_BACKOFF_S = 16.0  # retries of a stream that keeps failing come at most this far apart
KEY_JSON_BYTES = 40  # a key in an answer: 32-36 hex digits, quotes, a comma and a space
KEYS_PER_INDEX_KEY = 4  # snapshot keys per key the index keeps (windowed groups' keys come too, and are skipped)
ANSWER_SLACK_BYTES = 1 << 20  # the rest of an answer


def max_answer_bytes(max_keys: int) -> int:
    """The longest /kv_events answer read for an index of `max_keys` keys per instance (~42 MB by default)."""
    return KEYS_PER_INDEX_KEY * max_keys * KEY_JSON_BYTES + ANSWER_SLACK_BYTES


def decode(body: bytes, after: int | None, max_keys: int) -> tuple[KVEventsAnswer, SnapshotKeys | None]:
    """A read answer decoded (ValueError when malformed), with a snapshot's keys built: run in a worker thread."""
    answer = decode_answer(json.loads(body), after)  # json: 2x pydantic-core's speed on a list of hex strings
    return answer, None if answer.snapshot is None else snapshot_keys(answer.snapshot.keys, max_keys)


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
        self.max_answer_bytes = max(
            (max_answer_bytes(i.max_keys) for i in index.instances.values()), default=ANSWER_SLACK_BYTES
        )  # longer answers close their stream
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
        params = {"wait_s": f"{self.wait_s:g}"}
        if after is not None and inst.epoch is not None:
            params.update(after=str(after), epoch=inst.epoch)
        body = await get_bytes(self.session, "kv-events", url, "/kv_events", params, self.timeout_s,
                               self.max_answer_bytes)  # fmt: skip
        answer, built = await asyncio.to_thread(decode, body, after, inst.max_keys)  # this task alone changes inst
        self.index.apply(url, answer, built)
        state = self.metrics.streams[url]
        if answer.snapshot is not None:
            state.num_snapshots += 1
            if answer.snapshot.reason != "first" or state.num_snapshots > 1:
                log.info(
                    "kv events of %s: resynced from a snapshot (%s, %d keys, epoch %s)",
                    url, answer.snapshot.reason, len(answer.snapshot.keys), answer.epoch,
                )  # fmt: skip

    async def _wait_for_new_epoch(self, url: str, epoch: str) -> None:
        """Until `url`'s /health reports an epoch other than `epoch` (asked every max_backoff_s)."""
        while True:
            await asyncio.sleep(self.max_backoff_s)
            try:
                health = await get_json(self.session, "kv-events", url, "/health", self.timeout_s)
            except LegError:
                continue  # down, or restarting: ask again
            if not isinstance(health, dict) or health.get("epoch") != epoch:
                return

    async def _follow(self, url: str) -> None:
        state = self.metrics.streams[url]
        backoff = self.backoff_s
        logged_unexpected = False
        while True:
            try:
                await self.poll_once(url)
            except HashSchemeError as e:
                self.index.instances[url].reset()
                state.num_failures += 1
                state.up, state.last_error = False, str(e)
                log.error("kv events of %s: %s; not polled again until it restarts", url, e)
                await self._wait_for_new_epoch(url, e.epoch)
                continue
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
            except Exception as e:  # never let a stream's task die: the next poll starts over from a snapshot
                if not logged_unexpected:  # the traceback once; then one line per loss, as above
                    log.exception("kv events of %s: unexpected failure", url)
                elif state.up:
                    log.warning("kv events of %s: unexpected failure again: %r", url, e)
                logged_unexpected = True
                self.index.instances[url].reset()
                state.num_failures += 1
                state.up, state.last_error = False, f"unexpected failure: {e!r}"
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
