"""Push, decode side: one push recv as D's transfer thread holds it, and the steps it goes through.

A Wait lives from the RecvTask to its one result (RecvEnd): the handshake with every rank of P, one
PushRegister to each, then one PushDone per producer (the P ranks holding this rank's heads, heads.py), or,
after a timeout or an abort, every producer's answer to PushCancel (or its death). push_recv.RecvSide moves it
from state to state; it lives apart so its fields and their invariants read on one screen, without the
messages' handling (as pull_read.Read does for pull).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.kv.params import PushSource
from pdserve.transfer.base import RecvTask
from pdserve.transfer.thread.peers import Peer


class WaitState(enum.Enum):
    """D: a push recv's steps, in order (CANCELLING after a timeout or abort; STAGING only with a host mirror)."""

    HANDSHAKE = "handshake"  # waiting for P's handshake
    DELAYED = "delayed"  # handshake done, registration not sent yet
    REGISTERED = "registered"  # P has the registration: a WRITE may land
    CANCELLING = "cancelling"  # PushCancel sent: waiting until P says nothing more lands (or is known dead)
    STAGING = "staging"  # every producer's data landed in the mirror; copy-in pending


class CancelWhy(enum.Enum):
    ABORT = "abort"  # the engine aborted the request: reported as cancelled
    TIMEOUT = "timeout"  # the receive clock ran out: reported as failed


class RecvEnd(enum.Enum):
    """How a recv is reported to the engine (exactly once)."""

    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class Wait:
    """D: one request's push recv (this rank's heads), from handshake to every producer's PushDone or answer."""

    task: RecvTask
    remote: PushSource
    state: WaitState = WaitState.HANDSHAKE
    peers: dict[int, Peer] = field(default_factory=dict)  # P rank -> peer; every rank of P is registered with
    producers: set[int] = field(default_factory=set)  # P ranks that write this rank's heads (heads.py)
    done_ranks: set[int] = field(default_factory=set)  # producers whose data landed
    over_ranks: set[int] = field(default_factory=set)  # producers that will write nothing (more)
    num_bytes: int = 0
    sums: dict[int, list[int]] = field(default_factory=dict)  # --kv-checksum: producer rank -> its PushDone's sums
    first_token: int | None = None  # the prefill's first output token, from a PushDone (every producer's agree)
    registered_at: float = 0.0
    alive_at: float = 0.0  # time.monotonic() of the last sign of life (arrival, then P's PushQueued)
    num_queued: int = 0  # PushQueued notices received
    cancel_why: CancelWhy | None = None
    cancel_at: float = 0.0  # time.monotonic() of the first PushCancel
    fail_reason: str = ""

    @property
    def peer(self) -> Peer | None:
        """P's rank 0 (the address in the params)."""
        return self.peers.get(0)

    @property
    def num_producers(self) -> int:
        """PushDone to count: the P ranks holding this rank's heads, from both sides' TP sizes and KV heads in
        P's handshake (never the request's params)."""
        return len(self.producers)

    def is_producer(self, rank: int) -> bool:
        return rank in self.producers

    @property
    def key(self) -> tuple[str, int]:
        return self.remote.transfer_id, self.task.attempt

    @property
    def unlanded_end(self) -> RecvEnd:
        """How a recv that ends without its data is reported: cancelled if the engine aborted it, else failed."""
        return RecvEnd.CANCELLED if self.cancel_why is CancelWhy.ABORT else RecvEnd.FAILED
