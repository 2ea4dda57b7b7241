"""Who may hold a side-channel connection, and how refusals are counted (the server of handshake.py).

A connection is *pending* from its accept until its first complete frame, then *admitted* when that frame is a
valid request: with a deployment secret one that proves the secret, without one any well-formed frame. The two
kinds never compete for the same slots, so strangers cannot hold the slots peers need:
- pending: at most MAX_PENDING at once and MAX_PENDING_PER_SOURCE per source address, each closed unless its
  first frame is complete within FIRST_FRAME_TIMEOUT_S. A new connection is never refused for want of a
  pending slot: the oldest pending one of the same source (past the per-source limit) or of the source holding
  the most (past the total) is closed instead ("evicted"), a silent one before one that sent part of a frame.
  A peer sends its whole first frame within milliseconds of connecting, so the oldest pending connection is the
  one least likely to be a peer's; a flood of idle or half-sent connections so uses up only its own source's
  share, and a peer's fresh connection gets in even from the flood's own address.
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
FULL = "full"  # every admitted connection is answering a frame
FIRST_FRAME_TIMEOUT = "first_frame_timeout"  # no complete first frame in FIRST_FRAME_TIMEOUT_S
UNAUTHENTICATED = "unauthenticated"  # a request that failed authentication (or a plain/sealed mismatch)
MALFORMED = "malformed"  # a frame that is not a wire message


@dataclass(eq=False)
class Slot:
    """One served connection."""

    source: str  # the peer's address (host part only)
    close: Callable[[], None]  # closes the connection (its serving task then ends and calls release)
    has_data: Callable[[], bool]  # bytes of a frame arrived (evicted after the silent ones)
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

    def open(self, source: str, close: Callable[[], None], has_data: Callable[[], bool]) -> Slot:
        """A pending slot for a new connection from source (an older pending one may be closed for it)."""
        mine = self._by_source.get(source, {})
        if len(mine) >= self.max_pending_per_source:
            self._evict(mine)
        elif len(self._pending) >= self.max_pending:
            self._evict(max(self._by_source.values(), key=len))
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

    def _evict(self, slots: dict[Slot, None]) -> None:
        """Close the oldest silent pending connection of slots (not empty), or else the oldest of them."""
        victim = next((slot for slot in slots if not slot.has_data()), next(iter(slots)))
        self._drop_pending(victim)
        victim.close()
        self.refuse(EVICTED)

    def _drop_pending(self, slot: Slot) -> None:
        if slot in self._pending:
            del self._pending[slot]
            mine = self._by_source[slot.source]
            del mine[slot]
            if not mine:
                del self._by_source[slot.source]
