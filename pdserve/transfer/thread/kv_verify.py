"""--kv-checksum on the transfer thread: what each side sums for one part of a transfer (what one P rank sends
one D rank), and D's verdict before a recv is reported finished. The sum itself, and why it is defined over
logical rows rather than descriptor bytes, is checksum.py's.

- P sums its source blocks. Push: when it posts a D rank's WRITE; the sums ride in that WRITE's PushDone.
  Pull: when a D rank's PullRelease names the part it read; the sums ride in the PullReleaseAck (P answered
  with its coordinates before it knew D's block size, TP size or prefix hit, so it cannot sum D's part
  earlier, and P's pin keeps its blocks unchanged until then).
- D sums its own blocks once every READ/WRITE landed (after a test's flip_kv_byte) and compares, part by
  part, before the recv is reported finished: a mismatch fails the recv while the request is still
  WAITING_FOR_REMOTE_KV, and the engine fails it or recomputes it (--kv-load-failure-policy); its KV is never
  used. A part with no sums from P (a cancelled push whose data landed anyway) fails closed too.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.transfer.base import RecvTask, SendTask
from pdserve.transfer.layout import Heads
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.landing import landed_ranges
from pdserve.transfer.wire import PeerInfo
from pdserve.transfer.wire_notifs import PullRelease

Sums = list[int]  # [s1, s2] (checksum.KVChecksum.part); [] when not computed


def producer_sums(ctx: TransferContext, tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]],
                  heads: Heads) -> Sums:  # fmt: skip
    """P: the sums of one part over this rank's blocks (heads.local: this rank's first head of the part)."""
    if ctx.checksum is None:
        return []
    return ctx.checksum.part(tables, ranges, heads.local, heads.num)


def consumer_sums(ctx: TransferContext, task: RecvTask, producer: PeerInfo) -> dict[int, Sums]:
    """D, once everything landed: per producer rank, its part's sums over this rank's blocks ({} when off)."""
    ck = ctx.checksum
    if ck is None or task.num_tokens == 0:
        return {}
    ranges = landed_ranges(ctx, task, producer.geometry.block_size)
    parts = ctx.heads_from(producer)
    if ctx.faults.flip_kv_byte and parts:  # test: one corrupted byte in the first part's first row
        g, (first, _) = next((g, r) for g, r in enumerate(ranges) if r[0] < r[1])
        ck.flip_byte(task.tables[g], first, parts[min(parts)].local)
    return {p: ck.part(task.tables, ranges, h.local, h.num) for p, h in parts.items()}


def release_request(
    ctx: TransferContext, task: RecvTask, producer: PeerInfo, p_rank: int
) -> tuple[list[int], list[list[int]]]:
    """D (pull): what to ask P rank p_rank to sum in the PullRelease: (checksum_heads, checksum_ranges), empty
    when the checksum is off or that rank holds none of this rank's heads."""
    heads = ctx.heads_from(producer).get(p_rank)
    if ctx.checksum is None or heads is None or task.num_tokens == 0:
        return [], []
    ranges = landed_ranges(ctx, task, producer.geometry.block_size)
    return [heads.remote, heads.num], [[first, end] for first, end in ranges]


def release_sums(ctx: TransferContext, send: SendTask, msg: PullRelease) -> Sums:
    """P (pull): the sums a D rank's release asks for over the pinned blocks, or [] when it asks none or asks
    for rows or heads this rank's pin does not hold (D then fails closed)."""
    if ctx.checksum is None or len(msg.checksum_heads) != 2:
        return []
    h0, num = msg.checksum_heads
    ranges = [(r[0], r[1]) for r in msg.checksum_ranges if len(r) == 2]
    if not (num >= 1 and 0 <= h0 and h0 + num <= ctx.geometry.num_kv_heads) or len(ranges) != len(send.tables):
        return []
    bs = ctx.geometry.block_size
    for table, (first, end) in zip(send.tables, ranges, strict=True):
        if not 0 <= first <= end <= send.num_tokens:
            return []
        if any(not 0 <= b < ctx.geometry.num_blocks for b in table[first // bs : -(-end // bs)]):
            return []  # (a windowed group's STALE entries lie before its window)
    return ctx.checksum.part(send.tables, ranges, h0, num)


def mismatch(ctx: TransferContext, ours: dict[int, Sums], theirs: dict[int, Sums], engine_id: str | None) -> str | None:
    """D: None if every part's sums agree, else why not (counted in pdserve_kv_checksum_failures_total)."""
    for p_rank, mine in sorted(ours.items()):
        sent = theirs.get(p_rank) or []
        if sent != mine:
            if sent:  # (none sent: a push cancelled after its data landed; it fails closed, uncounted)
                ctx.sink.checksum_failed()
            said = f"sent {sent}" if sent else "sent no checksum"
            return (f"KV checksum mismatch: the prefill instance {engine_id} rank {p_rank} {said}, the KV received "
                    f"on rank {ctx.spec.tp_rank} sums to {mine}; the received KV is not used")  # fmt: skip
    return None
