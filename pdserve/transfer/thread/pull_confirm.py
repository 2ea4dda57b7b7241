"""Pull, decode side: how long D waits for P's PullReleaseAck after releasing the pin (docs/architecture.md).

"In time" (ConfirmDeadline.due): peer_timeout_s after the release, restarted when the last READ from that P
rank still in flight on this D (any request) is over, and never past P's lease of the request. A READ served in
order behind others (UCX's emulated GET) holds P's answer back until those are served: their time is not P's
silence. Waiting longer never weakens safety, which rests on held=True alone (P had the pin, untouched, when
the release sent after the READ was DONE arrived); past the lease P has freed the pin anyway, so D stops.
The deadline depends on every read in progress, not just its own, so it is kept apart from pull.PullCore,
which owns the reads and ends one when its deadline passes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.pull_read import Read, ReadState

STALL_S = 0.05  # a confirmation timer this late means this thread did not run: read what arrived before judging


class ConfirmDeadline:
    """D's confirmation deadlines over PullCore's reads (transfer thread only)."""

    def __init__(self, ctx: TransferContext, reads: dict[str, Read], expire: Callable[[str, Read, str], None]) -> None:
        self.ctx = ctx
        self.reads = reads  # PullCore's: request id -> pull in progress (shared, never copied)
        self.expire = expire  # ends a read whose deadline passed, with the error to report
        self.quiet_at: dict[str, float] = {}  # P rank's agent -> time.monotonic() its last READ here was over

    def start(self, rid: str, rd: Read) -> None:
        """rd's releases were sent (rd.released_at): arm its deadline."""
        self._arm(rid, rd, self.due(rd)[0])

    def due(self, rd: Read) -> tuple[float, bool]:
        """(when D stops waiting for rd's acks, whether P's lease cut the wait short): peer_timeout_s after the
        release, or after the last READ from an unacked P rank in flight here was over if that is later (none
        while one is in flight), but never past P's lease, unless that is before the plain deadline."""
        t = self.ctx.cfg.peer_timeout_s
        agents = {rd.peers[r].agent_name for r in rd.unacked}
        quiet = max((self.quiet_at.get(a, 0.0) for a in agents), default=0.0)
        wanted = math.inf if self._reading_from(agents) else max(rd.released_at, quiet) + t
        due = max(rd.released_at + t, min(wanted, rd.lease_end))
        return due, due < wanted

    def _reading_from(self, agents: set[str]) -> bool:
        """A READ from one of these P agents is in flight on this D (any request)."""
        return any(
            rd.state is ReadState.READING and any(x.peer in agents for x in rd.xfers.values())
            for rd in self.reads.values()
        )

    def reads_over(self, rd: Read) -> None:
        """rd's READs no longer hold P's answers back: restart the deadline of reads waiting behind them."""
        now, agents = time.monotonic(), {x.peer for x in rd.xfers.values()}
        for agent in agents:
            self.quiet_at[agent] = now
        for rid, other in self.reads.items():
            if other.state is ReadState.CONFIRMING and other is not rd:
                due, _ = self.due(other)
                if due < other.confirm_at:
                    self._arm(rid, other, due)

    def forget(self, agent_name: str) -> None:
        """A P rank is gone: its READs' history no longer matters."""
        self.quiet_at.pop(agent_name, None)

    def _arm(self, rid: str, rd: Read, at: float) -> None:
        rd.confirm_at = at
        self.ctx.thread.call_at(at, lambda: self._timeout(rid, rd, at))

    def _timeout(self, rid: str, rd: Read, at: float) -> None:
        if self.reads.get(rid) is not rd or rd.state is not ReadState.CONFIRMING or at != rd.confirm_at:
            return  # over, or a later deadline was armed
        now, (due, cut) = time.monotonic(), self.due(rd)
        # this thread did not run for a while (starved): judge after one turn of reading what came meanwhile
        late = due <= now and now - at > STALL_S and not rd.late
        if due > now or late:  # (or a READ from P went on past the deadline this timer was armed for)
            rd.late = late
            self._arm(rid, rd, max(due, now + STALL_S))
            return
        t, waited = self.ctx.cfg.peer_timeout_s, now - rd.released_at
        if cut:
            why = f"before its lease ran out ({waited:.1f} s after the release, READs from it in flight meanwhile)"
        else:
            why = f"within {t:g} s of the release (and of its last READ in flight here)"
        self.expire(rid, rd, f"the prefill instance did not confirm its pin {why}; the READ is unused")
