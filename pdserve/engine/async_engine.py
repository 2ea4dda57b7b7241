"""AsyncEngine: the engine loop on its own thread, fed and drained from an asyncio event loop.

Threads (owner: AsyncEngine): "engine-loop" runs LLMEngine.step(); the KV connector's transfer thread is
owned by LLMEngine. Shutdown order: stop the engine loop and join it, then LLMEngine.shutdown() joins the
transfer thread and releases the NIXL agent.

Chosen over a separate engine process: see docs/architecture.md ("Engine loop placement").
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.params import KVTransferParams

IDLE_WAIT_S = 1.0  # nothing to do at all: wake up at least this often
TRANSFER_WAIT_S = 0.05  # only transfers pending: a safety net; the transfer thread calls wakeup() on results


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    kv_sent_bytes: int
    kv_received_bytes: int
    transfers_ok: int
    transfers_failed: int
    transfers_expired: int
    num_engine_steps: int = 0  # LLMEngine.step() calls so far
    transfer_hook_seconds: float = 0.0  # engine-thread seconds spent in the connector hooks so far
    ttft_seconds: list[float] = field(default_factory=list)  # drained since the last call
    transfer_seconds: list[float] = field(default_factory=list)  # drained since the last call


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._engine: LLMEngine | None = None
        self._inbox: deque[tuple[str, Any]] = deque()  # ("add", args) | ("abort", request_id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self.error: str | None = None  # set if the engine loop died

    # ---- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model and start the engine loop (blocking; seconds)."""
        self._engine = LLMEngine(self.config, wakeup=self._wake.set)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("engine not started")
        return self._engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._engine is not None:
            self._engine.shutdown()

    # ---- requests -------------------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last has finished=True. Raises ValueError for bad input.
        Closing the generator early (client gone) aborts the request."""
        if not self.is_ready:
            raise RuntimeError(self.error or "engine is not ready")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._inbox.append(("add", (request_id, prompt_token_ids, params, kv_transfer_params)))
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
        self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---- the loop (engine thread) -----------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_inbox(engine)
                if engine.has_work() or engine.has_transfers():
                    self._dispatch(engine.step())
                if not engine.has_work() and not self._inbox:
                    self._wake.wait(TRANSFER_WAIT_S if engine.has_transfers() else IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as e:  # the engine is broken: fail every open request, report unhealthy
            self.error = f"engine loop died: {type(e).__name__}: {e}"
            for loop, queue in list(self._streams.values()):
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(self.error))
            raise

    def _drain_inbox(self, engine: LLMEngine) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                try:
                    engine.add_request(*arg)
                except ValueError as e:
                    self._send(arg[0], e)
            elif (out := engine.abort(arg)) is not None:
                self._send(arg, out)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._send(out.request_id, out)

    def _send(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    # ---- introspection (any thread) ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        e = self.engine
        s = e.scheduler
        t = e.kv_worker.stats()
        ttft = [e.ttft_seconds.popleft() for _ in range(len(e.ttft_seconds))]  # deque pops are atomic
        return EngineStats(
            num_blocks_total=e.num_blocks,
            num_blocks_free=e.pool.num_free,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.waiting_for_kv),
            kv_sent_bytes=t.sent_bytes,
            kv_received_bytes=t.received_bytes,
            transfers_ok=t.transfers_ok,
            transfers_failed=t.transfers_failed,
            transfers_expired=t.transfers_expired,
            num_engine_steps=e.num_steps,
            transfer_hook_seconds=e.transfer_hook_seconds,
            ttft_seconds=ttft,
            transfer_seconds=list(t.transfer_seconds),
        )

    def kv_transfer_info(self) -> dict[str, Any]:
        return self.engine.kv_scheduler.info()

    def timelines(self) -> list[dict[str, Any]]:
        return self.engine.timelines()
