"""Push, prefill side: one D rank's WRITE laid out (and prepared, before the prefill ends).

P's hand-over (its first token -> the WRITE posted) is on every push request's time to first token, and the
WRITE needs from the finished prefill only that it finished: the blocks it reads are known when the prompt's last
chunk is scheduled (StepMeta.planned), the blocks it writes when D's rank registers. Whichever of the two comes
second lays the WRITE out — segments, descriptors and NIXL's transfer request (agent.prepare) — while P still
computes (push_send.SendSide._prepare). When the prefill ends, push_write checks that the blocks the WRITE reads
are still those (fits(): a changed table is laid out again, never written wrong) and posts it with the PushDone
that only then is known (first token, checksum); the host mirror's copy (staging.py) also happens only then.
A registration that arrives after the prefill ended is laid out and posted at once, as before.

A PreparedWrite belongs to the registration it was built for (DestPart.prepared, push_rendezvous.py): setting
DestPart.reg to anything else releases it (NIXL's request freed), so a superseded, cancelled, refused or
expired registration and an abandoned or released transfer leave nothing behind; PreparedWrites counts the
live ones (TransferStats.prepared_writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.transfer.layout import Heads, LayoutError, descriptors, group_ranges, group_segments, pad_last_blocks
from pdserve.transfer.thread.agent import Prepared
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.wire_notifs import PushRegister


@dataclass(frozen=True)
class WriteLayout:
    """What one D rank's WRITE moves, and from which of P's blocks."""

    heads: Heads | None  # the head slice this P rank writes that D rank; None: none (other P ranks do)
    local: np.ndarray  # [num_descs, 3] (address, length, device id) in P's registered buffer
    remote: np.ndarray  # [num_descs, 3], row i matching local's row i, in D rank's cache
    ranges: tuple[tuple[int, int], ...]  # per KV group, the tokens [first, end) read (layout.group_ranges)
    used: tuple[tuple[int, ...], ...]  # per KV group, P's block ids holding those tokens (what fits() compares)

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0


def used_blocks(
    tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]], block_size: int
) -> tuple[tuple[int, ...], ...]:
    """Per KV group, the entries of P's table holding the tokens of its range (block_size: P's)."""
    return tuple(
        tuple(t[first // block_size : -(-end // block_size)]) for t, (first, end) in zip(tables, ranges, strict=True)
    )


def lay_out(
    ctx: TransferContext, tables: Sequence[Sequence[int]], msg: PushRegister, peer: Peer, event: Callable[[str], None]
) -> WriteLayout:
    """The WRITE of the tokens peer's registration msg names, from P's blocks `tables` (one per KV group):
    segments cut at both sides' block boundaries, D's last block padded when safe, descriptors merged
    (layout.py). event(name) marks the two parts on P's timeline. Raises LayoutError."""
    remote = peer.info.geometry
    if msg.block_size != remote.block_size:
        raise LayoutError(f"registration says block size {msg.block_size}, handshake said {remote.block_size}")
    segs = group_segments(
        ctx.geometry, tables, remote, msg.block_tables or [msg.block_ids], ctx.geometry.windows, msg.start_token,
        msg.num_tokens,
    )  # fmt: skip
    segs = pad_last_blocks(ctx.geometry, remote, segs)  # D's fresh blocks: safe (its docstring)
    event("write_segments")
    ranges = tuple(group_ranges(ctx.geometry.windows, msg.start_token, msg.num_tokens, ctx.geometry.block_size,
                                remote.block_size))  # fmt: skip
    used = used_blocks(tables, ranges, ctx.geometry.block_size)
    heads = ctx.heads_to(peer.info)  # this rank's slice of D's rank's heads (heads.py)
    if heads is None:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return WriteLayout(None, empty, empty, ranges, used)
    local, remote_rows = descriptors(ctx.spec, peer.info, segs, heads)
    event("write_descriptors")
    return WriteLayout(heads, local, remote_rows, ranges, used)


@dataclass
class PreparedWrite:
    """One D rank's WRITE laid out (and, when it moves bytes, NIXL's request created) before the prefill ended."""

    reg: object  # the push_rendezvous.Registration it writes (DestPart.reg while prepared), compared by identity
    end_token: int  # the registration's last token + 1: the finished prefill must cover it
    layout: WriteLayout
    # NIXL's request; None: nothing to post (zero tokens, no heads for that D rank), or NIXL refused to prepare it
    # (then the WRITE is posted from layout's rows)
    request: Prepared | None
    on_release: Callable[[PreparedWrite], None]  # PreparedWrites' bookkeeping

    def fits(self, num_tokens: int, tables: Sequence[Sequence[int]], block_size: int) -> bool:
        """The finished prefill (its KV covers num_tokens tokens, in `tables`) still holds what this WRITE reads
        where it was laid out to read it."""
        return self.end_token <= num_tokens and used_blocks(tables, self.layout.ranges, block_size) == self.layout.used

    def take(self) -> Prepared | None:
        """NIXL's request, for posting: from now on the caller owns it (this no longer counts as prepared)."""
        request, self.request = self.request, None
        self.on_release(self)
        return request

    def release(self) -> None:
        """Not to be posted: free NIXL's request (idempotent)."""
        if self.request is not None:
            self.request.release()
            self.request = None
        self.on_release(self)


class PreparedWrites:
    """The live PreparedWrites of this P rank (transfer thread only); their number is published to /metrics'
    snapshot (TransferStats.prepared_writes) whenever it changes."""

    def __init__(self, publish: Callable[[int], None]) -> None:
        self._live: set[int] = set()  # id() of each live PreparedWrite
        self._publish = publish

    def add(self, prepared: PreparedWrite) -> PreparedWrite:
        self._live.add(id(prepared))
        self._publish(len(self._live))
        return prepared

    def forget(self, prepared: PreparedWrite) -> None:
        if id(prepared) in self._live:
            self._live.discard(id(prepared))
            self._publish(len(self._live))

    def __len__(self) -> int:
        return len(self._live)
