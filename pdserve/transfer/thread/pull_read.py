"""Pull, decode side: one request's pull as D's transfer thread holds it, and the steps it goes through.

A Read lives from the RecvTask to its one result: the handshake with every rank of P, one READ per P rank
holding this rank's heads (post_reads), a PullRelease to each and their PullReleaseAcks. pull.PullCore moves it
from state to state and pull_confirm.ConfirmDeadline times its confirmation; both read it, so it lives apart
from either.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from pdserve.kv.params import PullSource
from pdserve.transfer.base import RecvTask
from pdserve.transfer.layout import LayoutError, descriptors, group_segments, num_bytes, pad_last_blocks
from pdserve.transfer.thread.agent import AgentError, PeerGone, Xfer
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.wire_notifs import PullRelease

log = logging.getLogger(__name__)


class ReadState(enum.Enum):
    """D: a pull's steps, in order (STAGING only with a host mirror)."""

    HANDSHAKE = "handshake"  # waiting for P's handshake
    POSTING = "posting"  # handshake done, READ not posted yet (only while a test delays it)
    READING = "reading"  # READ posted
    CONFIRMING = "confirming"  # READ done, PullRelease sent: waiting for P's PullReleaseAck (nothing more lands)
    STAGING = "staging"  # confirmed, landed in the mirror; copy-in pending (nothing more lands)


@dataclass
class Read:
    """D: one request's pull (this rank's heads), from handshake to every READ done and every P rank's ack."""

    task: RecvTask
    remote: PullSource
    state: ReadState = ReadState.HANDSHAKE
    peers: dict[int, Peer] = field(default_factory=dict)  # P rank -> peer (every rank of P; rank 0 first)
    xfers: dict[int, Xfer] = field(default_factory=dict)  # P rank -> the READ of this rank's heads it holds
    unacked: set[int] = field(default_factory=set)  # P ranks whose PullReleaseAck is awaited
    cancelled: bool = False  # aborted by the engine: report as cancelled when the READs are over
    released: set[int] = field(default_factory=set)  # P ranks sent a PullRelease (each is told exactly once)
    posted_at: float = 0.0
    lease_end: float = 0.0  # time.monotonic() by which P has freed its pin by lease (its capability's expiry)
    released_at: float = 0.0  # time.monotonic() the releases after the READ were sent (CONFIRMING)
    confirm_at: float = 0.0  # the armed confirmation timer's due time (an older timer is stale)
    late: bool = False  # the armed timer is the one extra turn given after a timer that fired late
    sums: dict[int, list[int]] = field(default_factory=dict)  # --kv-checksum: P rank -> D's sums of its part
    sent_sums: dict[int, list[int]] = field(default_factory=dict)  # P rank -> the sums its PullReleaseAck carried

    @property
    def peer(self) -> Peer | None:
        """P's rank 0 (the address in the params)."""
        return self.peers.get(0)

    @property
    def num_bytes(self) -> int:
        return sum(x.num_bytes for x in self.xfers.values())

    def release(self, p_rank: int, ok: bool, check: tuple[list[int], list[list[int]]] = ([], [])) -> PullRelease:
        """The PullRelease telling P rank p_rank this rank is done with its pin (ok: with the bytes read), marking
        that rank told (each is told exactly once); check: the part P is to sum (kv_verify.release_request)."""
        self.released.add(p_rank)
        xfer = self.xfers.get(p_rank)
        nbytes = xfer.num_bytes if ok and xfer is not None else 0
        return PullRelease(self.remote.request_id, ok, nbytes, list(self.remote.block_ids), *check)

    def ack_keys(self) -> list[tuple[str, str]]:
        """(P rank's agent, P's request id): how each P rank's PullReleaseAck finds this read."""
        return [(p.agent_name, self.remote.request_id) for p in self.peers.values()]


def post_reads(ctx: TransferContext, rd: Read) -> str | None:
    """Post one READ per P rank holding heads of this rank (heads.py) into rd.xfers: the tokens D lacks, every
    KV group's range (layout.py), D's partial last block padded (its fresh blocks: safe). None, or why a READ
    was not posted (the caller aborts those posted and ends the pull); a P rank found gone is forgotten."""
    task, remote = rd.task, rd.remote
    rd.posted_at = time.monotonic()  # a post may complete its READ
    for p_rank, heads in ctx.heads_from(rd.peers[0].info).items():
        peer = rd.peers[p_rank]
        try:
            segs = group_segments(ctx.geometry, task.tables, peer.info.geometry,
                                  remote.block_tables or (remote.block_ids,), ctx.geometry.windows,
                                  task.start_token, task.num_tokens)  # fmt: skip
            segs = pad_last_blocks(ctx.geometry, peer.info.geometry, segs)
            local_descs, remote_descs = descriptors(ctx.spec, peer.info, segs, heads)
            xfer = ctx.post("READ", local_descs, remote_descs, peer.agent_name, remote_memory=peer.info.memory)
        except (LayoutError, AgentError) as e:
            if isinstance(e, PeerGone):
                ctx.peers.forget(peer)
            return f"READ from {peer.engine_id} rank {p_rank} not posted: {e}"
        rd.xfers[p_rank] = xfer
        ctx.sink.posted(xfer.num_descs, xfer.post_seconds)
        if num_bytes(ctx.geometry, segs, heads) != xfer.num_bytes:  # a bug in layout.py, never the peer's
            log.error("pull: descriptor bytes %d != segment bytes", xfer.num_bytes)
    return None
