"""AsyncEngine: the engine loop on its own thread, fed and drained from an asyncio event loop.

Threads (owner: AsyncEngine): "engine-loop" runs LLMEngine.step(); the KV connector's transfer thread is
owned by LLMEngine. The prefix cache's event log (kv_events.py) is attached to the block pool before the loop
starts and starts no thread: the engine thread writes it, readers poll it. Shutdown order: stop the engine loop
and join it, then LLMEngine.shutdown() joins the transfer thread and releases the NIXL agent.

Chosen over a separate engine process: see docs/architecture.md ("Engine loop placement").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.client import (
    AbortIfQueued,
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineInfo,
    EngineStats,
    RefuseTransfer,
    ReleaseRequest,
)
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.params import PullSource, PushSource
from pdserve.model.tokenizer import Tokenizer
from pdserve.prompt_pack import to_list
from pdserve.transfer.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # nothing to do at all: wake up at least this often
TRANSFER_WAIT_S = 0.05  # only transfers pending: a safety net; the transfer thread calls wakeup() on results
STATS_EVERY_S = 0.1  # the engine thread republishes its stats snapshot at least this often while busy

OutputQueue = asyncio.Queue[RequestOutput | Exception]  # one request's stream, read on its event loop


class AsyncEngine:
    """Implements `pdserve.engine.client.EngineClient`. The event loop talks to the engine thread only through
    the command inbox (AddRequest / AbortRequest) and reads only what the engine thread published (EngineInfo
    at start, the EngineStats snapshot, outputs handed over with call_soon_threadsafe)."""

    def __init__(self, config: EngineConfig, faults: Faults = NO_FAULTS) -> None:
        self.config = config
        self.faults = faults  # a test's transfer faults (transfer/faults.py), for the engine's connectors
        self._engine: LLMEngine | None = None  # touched by the engine thread only, once started
        self._info: EngineInfo | None = None
        self._inbox: deque[EngineCommand] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._stats: EngineStats | None = None  # the latest snapshot the engine thread published
        self._stats_at = 0.0  # time.monotonic() of that snapshot
        self._error: str | None = None  # set if the engine loop died
        self._kv_events: KVEventLog | None = None  # the block pool's event log, once started

    # ---- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model and start the engine loop (blocking; seconds)."""
        engine = LLMEngine(self.config, wakeup=self._wake.set, faults=self.faults)
        self._engine = engine
        self._info = EngineInfo(
            model_name=engine.model_name,
            model_path=self.config.model.model,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            num_blocks=engine.num_blocks,
            block_size=self.config.cache.block_size,
            kv_transfer_info=engine.kv_scheduler.info(),  # before the loop starts: fixed from now on
            prefix_caching=self.config.cache.enable_prefix_caching,
        )
        self._kv_events = KVEventLog()
        engine.pool.record_events(self._kv_events)  # before the loop starts: the engine thread writes it from now on
        self._publish_stats(engine)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    @property
    def model_path(self) -> str:
        return self.config.model.model

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None if self._engine is None else self._engine.tokenizer

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._engine is not None:
            self._engine.shutdown()

    # ---- requests (event loop) --------------------------------------------------------------------------------
    async def generate(self, command: AddRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs as tokens arrive; the last has finished=True. Raises ValueError for bad input.
        Closing the generator early (client gone) aborts the request."""
        if not self.is_ready or self._engine is None:
            raise RuntimeError(self._error or "engine is not ready")
        try:
            self._engine.validate(command.prompt_token_ids, command.params, command.kv_transfer_params)
        except ValueError:
            self._refused(command)
            raise
        request_id = command.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._inbox.append(command)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.append(AbortRequest(request_id))
        self._wake.set()

    def refuse_transfer(self, source: PullSource | PushSource) -> None:
        if self.is_ready:
            self._inbox.append(RefuseTransfer(source))
            self._wake.set()

    def _refused(self, command: AddRequest) -> None:
        """The engine refused this request before queueing it: its producer frees the KV it names now."""
        if isinstance(source := command.kv_transfer_params, PullSource | PushSource):
            self.refuse_transfer(source)

    async def release(self, command: ReleaseRequest) -> bool:
        if not self.is_ready:
            raise RuntimeError(self._error or "engine is not ready")
        self._inbox.append(command)
        self._wake.set()
        return await asyncio.wrap_future(command.reply)

    async def abort_if_queued(self, request_id: str) -> bool:
        if not self.is_ready:
            return False
        command = AbortIfQueued(request_id)
        self._inbox.append(command)
        self._wake.set()
        # shielded: a caller that stops waiting must not cancel the future the engine thread will answer
        return await asyncio.shield(asyncio.wrap_future(command.reply))

    # ---- the loop (engine thread) -----------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self._engine
        assert engine is not None
        try:
            while not self._stop.is_set():
                self._drain_inbox(engine)
                if engine.has_work() or engine.has_transfers():
                    self._dispatch(engine.step(emit=self._dispatch))  # D's first tokens before the forward pass
                idle = not engine.has_work() and not self._inbox
                if idle or time.monotonic() - self._stats_at >= STATS_EVERY_S:
                    self._publish_stats(engine)
                if idle:
                    self._wake.wait(TRANSFER_WAIT_S if engine.has_transfers() else IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as e:  # the engine is broken: fail every open request, report unhealthy
            self._error = f"engine loop died: {type(e).__name__}: {e}"
            log.exception("engine loop died")
            for loop, queue in list(self._streams.values()):
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(self._error))
            raise

    def _drain_inbox(self, engine: LLMEngine) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, AbortRequest):
                if (out := engine.abort(command.request_id)) is not None:
                    self._send(command.request_id, out)
                continue
            if isinstance(command, AbortIfQueued):
                out = engine.abort_if_queued(command.request_id)
                if out is not None:
                    self._send(command.request_id, out)
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # never fail the loop for it
                    command.reply.set_result(out is not None)
                continue
            if isinstance(command, RefuseTransfer):
                engine.refuse_transfer(command.source)
                continue
            if isinstance(command, ReleaseRequest):
                found, out = engine.release(command.request_id, command.transfer_id)
                if out is not None:
                    self._send(out.request_id, out)
                command.reply.set_result(found)
                continue
            try:
                engine.add_request(
                    command.request_id,
                    to_list(command.prompt_token_ids),
                    command.params,
                    command.kv_transfer_params,
                    command.client_request_id,
                    validated=True,  # by generate(), on the event loop, against the same fixed limits
                )
            except ValueError as e:
                self._send(command.request_id, e)
                self._refused(command)
            except Exception as e:  # a request the engine cannot take fails alone, never the loop
                log.exception("request %s could not be added", command.request_id)
                self._send(command.request_id, RuntimeError(f"engine error: {type(e).__name__}: {e}"))
                self._refused(command)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one call_soon_threadsafe per event loop, not one per output: each
        call writes to the loop's self-pipe, and the loop it wakes takes the GIL from this thread mid-dispatch.
        At 8 streams on the CPU the time between steps went from 1.1-1.4 ms to 0.8-0.9 ms (docs/benchmarks.md)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputQueue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, queue = stream
                batches.setdefault(loop, []).append((queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _send(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _publish_stats(self, engine: LLMEngine) -> None:
        self._stats = engine.stats()  # one reference assignment: readers see the old or the new snapshot
        self._stats_at = time.monotonic()

    # ---- introspection (any thread) ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The latest snapshot, plus the TTFT and transfer-time observations made since the previous call."""
        if self._stats is None or self._engine is None:
            raise RuntimeError("engine not started")
        e = self._engine
        ttft = [e.ttft_seconds.popleft() for _ in range(len(e.ttft_seconds))]  # deque pops are atomic
        xfer = [e.transfer_seconds.popleft() for _ in range(len(e.transfer_seconds))]
        posts = [e.transfer_posts.popleft() for _ in range(len(e.transfer_posts))]
        return dataclasses.replace(
            self._stats,
            ttft_seconds=ttft,
            transfer_seconds=xfer,
            transfer_descriptors=[n for n, _ in posts],
            transfer_post_seconds=[s for _, s in posts],
        )

    def timelines(self) -> list[dict[str, Any]]:
        if self._engine is None:
            return []
        return self._engine.timelines()

    @property
    def kv_events(self) -> KVEventLog:
        if self._kv_events is None:
            raise RuntimeError("engine not started")
        return self._kv_events


def _put_all(items: list[tuple[OutputQueue, RequestOutput]]) -> None:
    """On the event loop: one step's outputs into their streams' queues, in step order."""
    for queue, out in items:
        queue.put_nowait(out)
