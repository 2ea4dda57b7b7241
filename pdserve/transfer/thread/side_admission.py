"""Who may hold a side-channel connection, and how refusals are counted (the server of handshake.py).

A connection is *pending* from its accept until its first complete frame, then *admitted* when that frame is a
valid request: with a deployment secret one that proves the secret, without one any well-formed frame. The two
kinds never compete for the same slots, so strangers cannot hold the slots peers need:
- pending: at most MAX_PENDING at once and MAX_PENDING_PER_SOURCE per source address, each closed unless its
  first frame is complete within FIRST_FRAME_TIMEOUT_S. A new connection is not refused for want of a pending
  slot while an older pending one has sent nothing: the oldest silent one of the same source (past the
  per-source limit) or of the source holding the most (past the total) is closed instead ("evicted"). A flood
  of idle connections so uses up only its own source's share, and a peer's fresh connection, which sends its
  frame at once, gets in even from the flood's own address.
- admitted: at most MAX_ADMITTED; one more closes the admitted connection waiting longest for its next frame,
  or is refused ("full") when every one is answering. With a secret only holders of the secret get here. A peer
  keeps its connection open between requests (handshake.py's client pool), so its liveness pings travel on a
  connection strangers cannot take.
Every refusal is counted by reason (TransferStats.side_channel_refused, pdserve_side_channel_refused_total on
/metrics) and logged as one summary line at most every LOG_INTERVAL_S, never one line per connection (a flood
once wrote 127,634 warnings in 24 s).

Side-channel thread only (no locks), except `counts()`, which copies under the GIL.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FIRST_FRAME_TIMEOUT_S = 1.0  # a pending connection's first frame must be complete this soon after its accept
MAX_PENDING = 64  # pending connections at once (not yet past their first frame)
MAX_PENDING_PER_SOURCE = 16  # pending connections of one source address
MAX_ADMITTED = 128  # admitted connections at once (past a valid first frame)
LOG_INTERVAL_S = 10.0  # at most one refusal summary line this often

# refusal reasons (the `reason` label of pdserve_side_channel_refused_total)
EVICTED = "evicted"  # pending and silent, closed to make room for a newer connection
FULL = "full"  # no slot, nothing to close for it
FIRST_FRAME_TIMEOUT = "first_frame_timeout"  # no complete first frame in FIRST_FRAME_TIMEOUT_S
UNAUTHENTICATED = "unauthenticated"  # a request that failed authentication (or a plain/sealed mismatch)
MALFORMED = "malformed"  # a frame that is not a wire message


@dataclass(eq=False)
class Slot:
    """One served connection."""

    source: str  # the peer's address (host part only)
    close: Callable[[], None]  # closes the connection (its serving task then ends and calls release)
    has_data: Callable[[], bool]  # bytes of a frame arrived (not silent: never evicted while pending)
    admitted: bool = False
    busy: bool = False  # admitted and answering a frame (never closed for another connection)
    idle_since: float = 0.0  # time.monotonic() an admitted connection last finished an answer


class Admission:
    """The slots of one side channel and its refusal counters."""

    def __init__(
        self,
        max_pending: int = MAX_PENDING,
        max_pending_per_source: int = MAX_PENDING_PER_SOURCE,
        max_admitted: int = MAX_ADMITTED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_pending, self.max_pending_per_source, self.max_admitted = (
            max_pending,
            max_pending_per_source,
            max_admitted,
        )
        self._clock = clock
        self._pending: dict[Slot, None] = {}  # oldest first
        self._by_source: dict[str, dict[Slot, None]] = {}  # pending ones per source, oldest first
        self._admitted: dict[Slot, None] = {}
        self._refused: Counter[str] = Counter()  # reason -> refusals since start
        self._unlogged: Counter[str] = Counter()  # reason -> refusals not yet in a log line
        self._next_log = 0.0  # time.monotonic() the next summary line may be written

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def counts(self) -> dict[str, int]:
        """Refusals since start by reason (safe from any thread)."""
        return dict(self._refused)

    def open(self, source: str, close: Callable[[], None], has_data: Callable[[], bool]) -> Slot | None:
        """A pending slot for a new connection from source, or None (refused, counted: the caller closes it)."""
        mine = self._by_source.get(source, {})
        if len(mine) >= self.max_pending_per_source:
            if not self._evict(mine):
                self.refuse(FULL)
                return None
        elif len(self._pending) >= self.max_pending:
            busiest = max(self._by_source.values(), key=len)
            if not self._evict(busiest) and not self._evict(self._pending):
                self.refuse(FULL)
                return None
        slot = Slot(source, close, has_data)
        self._pending[slot] = None
        self._by_source.setdefault(source, {})[slot] = None
        return slot

    def admit(self, slot: Slot) -> bool:
        """slot's first frame was a valid request: move it to the admitted slots (closing the one idle longest
        when they are all taken); False when every admitted connection is answering (refused, counted)."""
        self._drop_pending(slot)
        if len(self._admitted) >= self.max_admitted:
            idle = [s for s in self._admitted if not s.busy]
            if not idle:
                self.refuse(FULL)
                return False
            oldest = min(idle, key=lambda s: s.idle_since)
            del self._admitted[oldest]
            oldest.close()
        slot.admitted, slot.idle_since = True, self._clock()
        self._admitted[slot] = None
        return True

    def release(self, slot: Slot) -> None:
        """The connection is closed (any reason); idempotent."""
        self._drop_pending(slot)
        self._admitted.pop(slot, None)

    def refuse(self, reason: str) -> None:
        """Count a refusal; write the summary line when LOG_INTERVAL_S has passed since the last one."""
        self._refused[reason] += 1
        self._unlogged[reason] += 1
        now = self._clock()
        if now >= self._next_log:
            words = ", ".join(f"{n} {r}" for r, n in sorted(self._unlogged.items()))
            log.warning(
                "side channel: refused connections (%s) since the last such line; %d pending, %d admitted now; "
                "counted in pdserve_side_channel_refused_total, next line in %g s at the earliest",
                words, len(self._pending), len(self._admitted), LOG_INTERVAL_S,
            )  # fmt: skip
            self._unlogged.clear()
            self._next_log = now + LOG_INTERVAL_S

    def _evict(self, slots: dict[Slot, None]) -> bool:
        """Close the oldest silent pending connection of slots; False if each has sent something."""
        for slot in slots:
            if not slot.has_data():
                self._drop_pending(slot)
                slot.close()
                self.refuse(EVICTED)
                return True
        return False

    def _drop_pending(self, slot: Slot) -> None:
        if slot in self._pending:
            del self._pending[slot]
            mine = self._by_source[slot.source]
            del mine[slot]
            if not mine:
                del self._by_source[slot.source]
