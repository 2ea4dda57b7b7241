"""Push, prefill side: the state P's transfer thread keeps per transfer id, apart from the protocol that moves it.

A Rendezvous is one transfer id on this P rank: the finished prefill (once handed over) and one DestPart per D
rank (each rank of D registers on its own: its newest registration, its WRITE, how its part ended). Expected
says which transfer ids P's queued or running requests will produce; FinishedTransfers remembers, bounded, the
transfer ids that are over, so late messages for them are refused. Only push_send.SendSide changes these, on
the transfer thread; they live here so their invariants read on one screen, without the messages' handling.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.transfer.base import SendTask
from pdserve.transfer.thread.agent import Xfer
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.push_prepare import PreparedWrite
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire_notifs import PushRegister

MAX_FINISHED_IDS = 16384  # transfer ids remembered after they were written or expired (late messages)


@dataclass
class Registration:
    msg: PushRegister
    peer: Peer
    received_at: float  # time.time(), for the timeline
    keepalive_on: bool = False  # a PushQueued timer chain runs for this registration


@dataclass
class DestPart:
    """One D rank's part of a transfer: its newest registration, its WRITE, and how its part ended. `reg` (the
    newest registration not yet written) is a property: whatever replaces or clears it releases the WRITE
    prepared for it (push_prepare.py), so no path that drops a registration can leave a prepared WRITE behind."""

    _reg: Registration | None = None  # reg's value
    prepared: PreparedWrite | None = None  # reg's WRITE, laid out before the prefill ended (push_prepare.py)
    max_attempt: int = -1  # newest attempt seen from this D rank; older registrations are refused
    write_reg: Registration | None = None  # the registration being written
    xfer: Xfer | None = None  # the WRITE in flight (None for a zero-token transfer)
    posted_at: float = 0.0
    cancel_asked: bool = False  # D's rank cancelled the attempt being written: ack when the write is over
    silent: bool = False  # this P rank sends that D rank no heads (heads.py): nothing written, no PushDone
    ended: tuple[int, str] | None = None  # its part is over: (attempt written, or -1, why later ones are refused)

    @property
    def writing(self) -> bool:
        return self.write_reg is not None

    @property
    def reg(self) -> Registration | None:
        return self._reg

    @reg.setter
    def reg(self, reg: Registration | None) -> None:
        if self.prepared is not None and self.prepared.reg is not reg:
            self.prepared.release()
            self.prepared = None
        self._reg = reg

    def take_prepared(self) -> PreparedWrite | None:
        """The WRITE prepared for reg, now the caller's (it is about to be written)."""
        prepared, self.prepared = self.prepared, None
        return prepared


@dataclass
class Rendezvous:
    """One transfer id on this P rank: the finished prefill and every D rank's part. The send (P's blocks) is
    over when every D rank's part is (num_dests known from the first registration's handshake), or at once, once
    no WRITE is in flight, after a failure, a release or an expiry (outcome not OK)."""

    transfer_id: str
    send: SendTask | None = None  # the finished prefill (P's blocks), once handed over
    num_dests: int = 0  # D's TP size (its ranks register separately); 0 until the first registration
    dests: dict[int, DestPart] = field(default_factory=dict)  # D rank -> its part
    outcome: SendOutcome = SendOutcome.OK  # FAILED/EXPIRED once the transfer can no longer succeed
    error: str = ""  # the first failure's
    num_bytes: int = 0  # written so far, over every D rank
    seconds: float | None = None  # the longest WRITE's duration
    # why D gave the transfer up (PushCancel of a rank's newest attempt, or a refusal) before the prefill was
    # handed over: it is freed when it is, unless a D rank registers a newer attempt first (None: not given up)
    given_up: str | None = None

    def dest(self, d_rank: int) -> DestPart:
        return self.dests.setdefault(d_rank, DestPart())

    @property
    def writing(self) -> bool:
        return any(x.writing for x in self.dests.values())

    @property
    def is_empty(self) -> bool:
        return self.send is None and not self.writing and all(x.reg is None for x in self.dests.values())

    @property
    def all_written(self) -> bool:
        return self.num_dests > 0 and all(
            (x := self.dests.get(d)) is not None and x.ended is not None for d in range(self.num_dests)
        )


class Expected:
    """P's requests queued or running and the transfer id each produces (StepMeta.expected), until each sends
    or is abandoned: a registration for an expected transfer waits as long as P works on it."""

    def __init__(self) -> None:
        self._rids: dict[str, set[str]] = {}  # transfer id -> P request ids queued or running that produce it
        self._tid: dict[str, str] = {}  # P request id -> transfer id (the inverse of _rids)

    def add(self, request_id: str, tid: str) -> None:
        self._rids.setdefault(tid, set()).add(request_id)
        self._tid[request_id] = tid

    def remove(self, request_id: str) -> str | None:
        """The request's expectation is over (it sent or was abandoned); returns its transfer id if it had one."""
        tid = self._tid.pop(request_id, None)
        if tid is not None and (rids := self._rids.get(tid)) is not None:
            rids.discard(request_id)
            if not rids:
                del self._rids[tid]
        return tid

    def __contains__(self, tid: str) -> bool:
        """Some request of P still produces this transfer."""
        return tid in self._rids


class FinishedTransfers:
    """Transfer ids that are over, oldest forgotten first (at most MAX_FINISHED_IDS): for each, the attempt
    written per D rank (a late PushCancel learns whether its data landed) and why a later registration is
    refused."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, tuple[dict[int, int], str]] = OrderedDict()

    def add(self, tid: str, written: dict[int, int], why: str) -> None:
        self._ids[tid] = (written, why)
        while len(self._ids) > MAX_FINISHED_IDS:
            self._ids.popitem(last=False)

    def get(self, tid: str) -> tuple[dict[int, int], str] | None:
        return self._ids.get(tid)

    def __contains__(self, tid: str) -> bool:
        return tid in self._ids
