"""Pull, decode side: one request's pull as D's transfer thread holds it, and the steps it goes through.

A Read lives from the RecvTask to its one result: the handshake with every rank of P, one READ per P rank
holding this rank's heads, a PullRelease to each and their PullReleaseAcks. pull.PullCore moves it from state
to state and pull_confirm.ConfirmDeadline times its confirmation; both read it, so it lives apart from either.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.kv.params import PullSource
from pdserve.transfer.base import RecvTask
from pdserve.transfer.thread.agent import Xfer
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.wire_notifs import PullRelease


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
