"""TransferLoop, the transfer thread: the one thread per instance (per rank) that owns the NIXL agent.

Everything that touches the agent runs here: commands from the engine (StepMeta) and from the side channel
arrive on a queue as callables; timers fire here; each loop turn the mode's core polls posted transfers and
incoming notifications (with NIXL's progress thread off, this polling *is* what moves data).

The loop is event-driven: while the core reports latency-critical work (a transfer in flight, a request
waiting for a notification) it sleeps HOT_POLL_S between turns; otherwise it blocks on its wake event for
at most IDLE_POLL_S. Every state in which a peer's transfer needs this side to poll (P holding pins a D may
READ, D's registered blocks P WRITEs into, a READ or WRITE posted) is hot, so the idle poll only bounds how
late a notification for a request this instance does not know yet is read — and the command that makes the
request known wakes the loop, which reads it then. A command or a due timer wakes it at once. (At 1 ms an idle
instance cost 7% of a core of a 2-core Zen 1 host; at 10 ms 2.4%, heartbeats and all.)
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

HOT_POLL_S = 50e-6  # sleep between polls while latency-critical work is pending
IDLE_POLL_S = 10e-3  # longest block on the wake event otherwise (nothing a peer does waits on it: see above)
DRAIN_S = 2.0  # on shutdown, how long in-flight transfers get to finish before the agent goes


class Core(Protocol):
    """What the loop drives each turn (worker.py's dispatch over a mode's core). Called only on the thread."""

    def progress(self, now: float) -> bool:
        """Poll posted transfers and notifications; True while latency-critical work is pending."""
        ...

    def in_flight(self) -> bool:
        """True while a posted READ/WRITE has not completed (shutdown waits for these)."""
        ...


class TransferLoop:
    def __init__(self, name: str) -> None:
        self.name = name
        self._commands: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Callable[[], Any]]] = []  # heap of (monotonic due time, seq, fn)
        self._seq = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._core: Core | None = None

    # ---- life cycle (called by the owning ConnectorWorker) ----------------------------------------------------------
    def start(self, core: Core) -> None:
        self._core = core
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let in-flight transfers finish (up to DRAIN_S), then stop and join the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- scheduling work on the thread (any thread) -----------------------------------------------------------------
    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the transfer thread, in posting order."""
        self._commands.put(fn)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run fn on the transfer thread and return a future of its result (for the side channel)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)

        self.post(run)
        return fut

    def call_at(self, when: float, fn: Callable[[], Any]) -> None:
        """Run fn on the transfer thread at time.monotonic() >= when. Only from the transfer thread."""
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self._core
        assert core is not None
        drain_until = None
        while True:
            self._wake.clear()
            now = time.monotonic()
            self._run_commands()
            while self._timers and self._timers[0][0] <= now:
                self._guard(heapq.heappop(self._timers)[2])
            hot = self._guard(lambda: core.progress(now))  # noqa: B023 (called at once)
            if self._stop.is_set():
                drain_until = drain_until or now + DRAIN_S
                if not core.in_flight() or now >= drain_until:
                    if core.in_flight():
                        log.warning("%s: stopping with transfers still in flight", self.name)
                    return
            wait = HOT_POLL_S if hot or self._stop.is_set() else IDLE_POLL_S
            if self._timers:
                wait = max(0.0, min(wait, self._timers[0][0] - time.monotonic()))
            self._wake.wait(wait)

    def _run_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            self._guard(fn)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run fn; an exception is a bug, logged, and never kills the thread."""
        try:
            return fn()
        except Exception:
            log.exception("%s: unexpected error (the request involved may hang until its timeout)", self.name)
            return False
