"""Push, prefill side (transfer thread): the rendezvous of D's registration and P's finished prefill.

Both arrive in either order, keyed by transfer_id; each rank of D registers on its own (its agent, its blocks),
so a rendezvous holds one part per D rank (_Dest, keyed by the rank from D's handshake). A registration carries
an attempt number and only a rank's newest attempt is ever written (older ones get PushFail). Whichever arrives
second triggers one WRITE of the heads that D rank takes from this P rank (heads.py; none: the part ends
silently), carrying a PushDone, which NIXL delivers after the data. P's blocks are handed back
(finished_sends) when every D rank's part is over (D's TP size comes from its handshake), never while a WRITE
is in flight; a failed part refuses the other D ranks at once (the request cannot run on D) and the blocks go
as soon as nothing is in flight.

P's scheduler half says at arrival which transfer ids P will produce (StepMeta.expected) and which of those
ended without a prefill to hand over (StepMeta.abandoned: aborted while queued or running). A registration
for an expected transfer waits as long as P works on it: P answers it with PushQueued at once and then every
keepalive_ms the registration asked for (D's receive clock restarts on each), and with PushFail at once if
the request is abandoned (an abandoned transfer id is remembered: a later registration is refused at once).

Timeouts: a registration for a transfer P does not expect (its prefill leg never arrived, or is not here
yet) and without a finished prefill after push_registration_timeout_s is dropped (PushFail tells D, whose
blocks are then safe); a finished prefill that not every D rank registered for after lease_s is freed
("expired"). A D rank's PushCancel is answered with PushCancelAck once nothing more can land in that rank's
blocks for that attempt. Keepalives (PushQueued), cancels and PushFail are all per D rank.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.transfer.base import SendTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.heads import num_producers
from pdserve.transfer.layout import LayoutError, descriptors, group_ranges, group_segments, pad_last_blocks
from pdserve.transfer.thread.agent import AgentError, PeerGone, Xfer, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire import (
    Message,
    PushCancel,
    PushCancelAck,
    PushDone,
    PushFail,
    PushQueued,
    PushRegister,
    encode,
)

log = logging.getLogger(__name__)

MAX_FINISHED_IDS = 16384  # transfer ids remembered after they were written or expired (late messages)
MIN_KEEPALIVE_S = 0.05  # PushQueued goes at most this often per registration, whatever D asks for
ABANDONED = "the prefill request was aborted on the prefill instance"


@dataclass
class _Reg:
    msg: PushRegister
    peer: Peer
    received_at: float  # time.time(), for the timeline
    keepalive_on: bool = False  # a PushQueued timer chain runs for this registration


@dataclass
class _Dest:
    """One D rank's part of a transfer: its newest registration, its WRITE, and how its part ended."""

    reg: _Reg | None = None  # the newest registration not yet written
    max_attempt: int = -1  # newest attempt seen from this D rank; older registrations are refused
    write_reg: _Reg | None = None  # the registration being written
    xfer: Xfer | None = None  # the WRITE in flight (None for a zero-token transfer)
    posted_at: float = 0.0
    cancel_asked: bool = False  # D's rank cancelled the attempt being written: ack when the write is over
    silent: bool = False  # this P rank sends that D rank no heads (heads.py): nothing written, no PushDone
    ended: tuple[int, str] | None = None  # its part is over: (attempt written, or -1, why later ones are refused)

    @property
    def writing(self) -> bool:
        return self.write_reg is not None


@dataclass
class _Rendezvous:
    """One transfer id on this P rank: the finished prefill and every D rank's part. The send (P's blocks) is
    over when every D rank's part is (num_dests known from the first registration's handshake), or at once, once
    no WRITE is in flight, after a failure, a release or an expiry (outcome not OK)."""

    transfer_id: str
    send: SendTask | None = None  # the finished prefill (P's blocks), once handed over
    num_dests: int = 0  # D's TP size (its ranks register separately); 0 until the first registration
    dests: dict[int, _Dest] = field(default_factory=dict)  # D rank -> its part
    outcome: SendOutcome = SendOutcome.OK  # FAILED/EXPIRED once the transfer can no longer succeed
    error: str = ""  # the first failure's
    num_bytes: int = 0  # written so far, over every D rank
    seconds: float | None = None  # the longest WRITE's duration

    def dest(self, d_rank: int) -> _Dest:
        return self.dests.setdefault(d_rank, _Dest())

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


class SendSide:
    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.rv: dict[str, _Rendezvous] = {}
        # transfer id -> ({D rank: attempt written}, why later registrations are refused), once over
        self.finished: OrderedDict[str, tuple[dict[int, int], str]] = OrderedDict()
        self.producers: dict[str, set[str]] = {}  # transfer id -> P request ids queued or running that produce it
        self.producer_tid: dict[str, str] = {}  # P request id -> transfer id (the inverse of producers)

    # ---- P's own requests: expected at arrival, then exactly one send or abandon ------------------------------------
    def on_expect(self, request_id: str, tid: str, now: float) -> None:
        if tid in self.finished:  # its send will be refused as a second prefill
            log.warning("push: request %s produces transfer %s, which is already over", request_id, tid)
            return
        self.producers.setdefault(tid, set()).add(request_id)
        self.producer_tid[request_id] = tid
        r = self.rv.get(tid)
        for d_rank, x in r.dests.items() if r is not None else ():
            if x.reg is not None:  # D registered before P's request arrived: tell D now
                self._start_keepalive(tid, d_rank, x.reg)

    def _unexpect(self, request_id: str) -> str | None:
        """The request's expectation is over (it sent or was abandoned); returns its transfer id if it had one."""
        tid = self.producer_tid.pop(request_id, None)
        if tid is not None and (rids := self.producers.get(tid)) is not None:
            rids.discard(request_id)
            if not rids:
                del self.producers[tid]
        return tid

    def on_abandon(self, request_id: str) -> None:
        tid = self._unexpect(request_id)
        if tid is None or tid in self.producers:
            return  # not expected, or another request of P still produces this transfer
        r = self.rv.get(tid)
        if r is not None and (r.send is not None or r.writing):
            return  # another prefill was handed over for it: that one is written
        log.info("push: transfer %s abandoned (request %s aborted)", tid, request_id)
        self._done(r or _Rendezvous(tid), ABANDONED)  # pending registrations get PushFail now

    # ---- the finished prefill ---------------------------------------------------------------------------------------
    def on_send(self, task: SendTask, now: float) -> None:
        self.ctx.cfg.faults.defer(FaultPoint.SEND_READY, self.ctx.thread.call_at,
                                  lambda: self._add_send(task, time.monotonic()))  # fmt: skip

    def _add_send(self, task: SendTask, now: float) -> None:
        tid = task.transfer_id
        assert tid is not None  # the push scheduler half sends only tasks with a transfer id
        self._unexpect(task.request_id)
        r = self.rv.get(tid) or _Rendezvous(tid)
        if r.send is not None or r.writing or tid in self.finished:
            log.warning("push: a second prefill for transfer %s (request %s); freeing it", tid, task.request_id)
            self.ctx.sink.send_finished(task.request_id, SendOutcome.FAILED)
            return
        self.rv[tid] = r
        r.send = task
        self.ctx.thread.call_at(now + self.ctx.cfg.lease_s, lambda: self._expire_send(tid, task))
        for d_rank, x in list(r.dests.items()):
            if x.reg is not None:
                self.ctx.sink.event(task.request_id, "registration_received", x.reg.received_at)
                self._write(r, d_rank)

    def on_release(self, request_id: str) -> None:
        """The engine gives up this finished prefill's pin (abort, POST /kv_transfer/release): free it now, and
        refuse D's registrations; WRITEs in flight are let finish (they read these blocks), then they are freed."""
        for r in list(self.rv.values()):
            if r.send is not None and r.send.request_id == request_id:
                log.info("push: transfer %s released on the prefill instance (request %s)", r.transfer_id, request_id)
                why = "the prefill instance released the KV (request aborted or its decode leg failed)"
                self._give_up(r, SendOutcome.FAILED, why)
                return

    def _expire_send(self, tid: str, task: SendTask) -> None:
        r = self.rv.get(tid)
        if r is None or r.send is not task or r.outcome is not SendOutcome.OK:
            return
        if r.num_dests and all((x := r.dests.get(d)) is not None and (x.writing or x.ended is not None)
                               for d in range(r.num_dests)):  # fmt: skip
            return  # every D rank registered: the WRITEs end the send
        log.info("push: not every rank of D registered for %s within %g s; freeing its blocks", tid,
                 self.ctx.cfg.lease_s)  # fmt: skip
        self._give_up(r, SendOutcome.EXPIRED, "the prefill's KV expired before D registered")

    def _give_up(self, r: _Rendezvous, outcome: SendOutcome, why: str) -> None:
        """The transfer can no longer succeed: refuse every D rank not being written; the send ends (P's blocks
        freed) once no WRITE is in flight."""
        if r.outcome is SendOutcome.OK:
            r.outcome, r.error = outcome, why
        for x in r.dests.values():
            if x.reg is not None:
                self._fail(x.reg.peer, r.transfer_id, x.reg.msg.attempt, why)
                x.reg = None
            if not x.writing and x.ended is None:
                x.ended = (-1, why)
        self._maybe_finish(r)

    def _maybe_finish(self, r: _Rendezvous) -> None:
        """Free P's blocks once every D rank's part is over (or, after a failure, once nothing is in flight)."""
        send = r.send
        if send is None or r.writing or not (r.all_written or r.outcome is not SendOutcome.OK):
            return
        r.send = None
        ok = r.outcome is SendOutcome.OK
        if ok and not all(x.silent for x in r.dests.values()):
            self.ctx.sink.event(send.request_id, "transfer_done")
        self.ctx.sink.send_finished(send.request_id, r.outcome, r.num_bytes if ok else 0, r.seconds if ok else None)
        self._done(r, "the KV was already written" if ok else f"the transfer failed: {r.error}")

    # ---- D's messages -----------------------------------------------------------------------------------------------
    def on_register(self, sender: str, msg: PushRegister, now: float) -> None:
        peer = self.ctx.peers.by_agent(sender)
        if peer is None:
            log.warning(
                "push: registration for %s from unknown agent %s (no handshake); dropped", msg.transfer_id, sender
            )
            return
        tid, d_rank = msg.transfer_id, peer.info.tp_rank
        if (fin := self.finished.get(tid)) is not None:
            self._fail(peer, tid, msg.attempt, fin[1])
            return
        r = self.rv.setdefault(tid, _Rendezvous(tid))
        if msg.tp_rank != d_rank or peer.info.tp_size != (r.num_dests or peer.info.tp_size):
            self._fail(peer, tid, msg.attempt, f"registration from D rank {msg.tp_rank} of TP {peer.info.tp_size} "
                       f"(handshake: rank {d_rank}; other ranks said TP {r.num_dests})")  # fmt: skip
            if r.is_empty and not r.dests:
                del self.rv[tid]
            return
        if r.outcome is not SendOutcome.OK:  # failed or released, a WRITE to another D rank still in flight
            self._fail(peer, tid, msg.attempt, r.error)
            return
        r.num_dests = peer.info.tp_size
        x = r.dest(d_rank)
        if x.ended is not None:
            self._fail(peer, tid, msg.attempt, x.ended[1])
            return
        if msg.attempt <= x.max_attempt:
            self._fail(peer, tid, msg.attempt, f"attempt {msg.attempt} is superseded by attempt {x.max_attempt}")
            return
        x.max_attempt = msg.attempt
        if x.reg is not None:
            self._fail(x.reg.peer, tid, x.reg.msg.attempt, f"superseded by attempt {msg.attempt}")
        reg = x.reg = _Reg(msg, peer, time.time())
        timeout = self.ctx.cfg.push_registration_timeout_s
        self.ctx.thread.call_at(now + timeout, lambda: self._expire_reg(tid, d_rank, reg))
        if r.send is not None:
            self.ctx.sink.event(r.send.request_id, "registration_received", reg.received_at)
            if not x.writing:
                self._write(r, d_rank)
        elif tid in self.producers:
            self._start_keepalive(tid, d_rank, reg)

    def _expire_reg(self, tid: str, d_rank: int, reg: _Reg) -> None:
        r = self.rv.get(tid)
        if r is None or (x := r.dests.get(d_rank)) is None or x.reg is not reg:
            return
        timeout = self.ctx.cfg.push_registration_timeout_s
        if tid in self.producers:  # P is working on this prefill: the registration waits as long as that takes
            self.ctx.thread.call_at(time.monotonic() + timeout, lambda: self._expire_reg(tid, d_rank, reg))
            return
        x.reg = None
        why = f"the prefill did not finish within {timeout:g} s (no request for this transfer arrived here)"
        self._fail(reg.peer, tid, reg.msg.attempt, why)
        if r.is_empty:
            del self.rv[tid]

    def _start_keepalive(self, tid: str, d_rank: int, reg: _Reg) -> None:
        if not reg.keepalive_on:
            reg.keepalive_on = True
            self._keepalive(tid, d_rank, reg)

    def _keepalive(self, tid: str, d_rank: int, reg: _Reg) -> None:
        """PushQueued to D's rank now and every keepalive_ms, while reg waits for a prefill P is working on."""
        r = self.rv.get(tid)
        x = r.dests.get(d_rank) if r is not None else None
        if x is None or x.reg is not reg or tid not in self.producers:
            reg.keepalive_on = False  # written, superseded, cancelled, failed, or no longer expected
            return
        self._notify(reg.peer.agent_name, PushQueued(tid, reg.msg.attempt))
        every = max(MIN_KEEPALIVE_S, reg.msg.keepalive_ms / 1000)
        self.ctx.thread.call_at(time.monotonic() + every, lambda: self._keepalive(tid, d_rank, reg))

    def on_cancel(self, sender: str, msg: PushCancel) -> None:
        tid, attempt = msg.transfer_id, msg.attempt
        peer = self.ctx.peers.by_agent(sender)
        if peer is None:
            return  # unknown (or forgotten) agent: nothing was written for it
        d_rank = peer.info.tp_rank
        r = self.rv.get(tid)
        x = r.dests.get(d_rank) if r is not None else None
        if x is not None and x.write_reg is not None and x.write_reg.msg.attempt == attempt:
            x.cancel_asked = True  # acked when the write is over
            return
        if r is not None and x is not None and x.reg is not None and x.reg.msg.attempt == attempt:
            x.reg = None
            if r.is_empty:
                del self.rv[tid]
        if x is not None and x.ended is not None:
            landed = x.ended[0] == attempt
        else:
            landed = (fin := self.finished.get(tid)) is not None and fin[0].get(d_rank) == attempt
        self._notify(sender, PushCancelAck(tid, attempt, self._rank, landed))

    # ---- the write --------------------------------------------------------------------------------------------------
    @property
    def _rank(self) -> int:
        return self.ctx.spec.tp_rank

    def _ranges(self, msg: PushRegister, remote_block_size: int) -> list[tuple[int, int]]:
        """Per KV group, the tokens this WRITE reads (layout.group_ranges)."""
        bs = (self.ctx.layout.block_size, remote_block_size)
        return group_ranges(self.ctx.spec.windows, msg.start_token, msg.num_tokens, *bs)

    def _write(self, r: _Rendezvous, d_rank: int) -> None:
        """Write D rank d_rank's newest registration: the heads it takes from this P rank, with one PushDone."""
        x = r.dests[d_rank]
        reg, send = x.reg, r.send
        assert reg is not None and send is not None
        x.reg, x.write_reg, x.cancel_asked = None, reg, False
        msg, peer = reg.msg, reg.peer
        try:
            if msg.block_size != peer.info.block_size:
                raise LayoutError(
                    f"registration says block size {msg.block_size}, handshake said {peer.info.block_size}"
                )
            if msg.start_token + msg.num_tokens > send.num_tokens:
                raise LayoutError(
                    f"the prefill has KV for {send.num_tokens} tokens, D asked up to {msg.start_token + msg.num_tokens}"
                )
            segs = group_segments(
                self.ctx.layout, send.tables, peer.layout, msg.block_tables or [msg.block_ids], self.ctx.spec.windows,
                msg.start_token, msg.num_tokens,
            )  # fmt: skip
            segs = pad_last_blocks(self.ctx.layout, peer.layout, segs)  # D's fresh blocks: safe (its docstring)
            heads = self.ctx.heads_to(peer.info)  # this rank's slice of D's rank's heads (heads.py)
            if heads is not None:
                local, remote = descriptors(self.ctx.layout, peer.layout, segs, heads)
        except LayoutError as e:
            self._write_over(r, d_rank, False, f"cannot write: {e}")
            return
        if heads is None:  # D's rank gets its heads from other ranks of P: this rank's part is over, unannounced
            x.silent = True
            self._write_over(r, d_rank, True, None)
            return
        nbytes = int(local[:, 1].sum()) if len(local) else 0
        n_prod = num_producers(self.ctx.spec.model_kv_heads, self.ctx.spec.tp_size, peer.info.tp_size, d_rank)
        done = encode(PushDone(r.transfer_id, msg.attempt, self._rank, n_prod, nbytes))
        x.posted_at, posted_wall = time.monotonic(), time.time()  # the post may complete the WRITE
        try:
            if msg.num_tokens == 0:
                self.ctx.agent.send_notif(peer.agent_name, done)
            else:
                if self.ctx.stager is not None:  # KV cache -> host mirror, exactly the blocks this WRITE reads
                    for table, (first, end) in zip(send.tables, self._ranges(msg, peer.layout.block_size), strict=True):
                        self.ctx.stager.stage_out(table, first, end - first)
                x.xfer = self.ctx.post("WRITE", local, remote, peer.agent_name, done, peer.info.memory)
        except (AgentError, RuntimeError) as e:
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(peer)
            self._write_over(r, d_rank, False, f"WRITE to {peer.engine_id} rank {d_rank} not posted: {e}")
            return
        self.ctx.sink.event(send.request_id, "transfer_posted", posted_wall)
        if x.xfer is not None:
            self.ctx.sink.posted(x.xfer.num_descs, x.xfer.post_seconds)
        self._check(r, d_rank)

    def progress(self, now: float) -> bool:
        hot = False
        for r in list(self.rv.values()):
            for d_rank, x in list(r.dests.items()):
                if x.writing:
                    self._check(r, d_rank)
            hot = hot or r.send is not None  # writing, or waiting for a rank of D to register: poll fast
        return hot

    def in_flight(self) -> bool:
        return any(x.xfer is not None for r in self.rv.values() for x in r.dests.values())

    def _check(self, r: _Rendezvous, d_rank: int) -> None:
        x = r.dests[d_rank]
        if x.xfer is None:  # zero tokens: the notification was the whole transfer
            self._write_over(r, d_rank, True, None)
            return
        assert x.write_reg is not None
        peer = x.write_reg.peer
        try:
            state = self.ctx.agent.check(x.xfer)
        except PeerGone as e:
            self.ctx.peers.forget(peer)
            self._write_over(r, d_rank, False, f"decode instance {peer.engine_id} rank {d_rank} went away: {e}")
            return
        if state is XferState.DONE:
            self._write_over(r, d_rank, True, None)
        elif state is XferState.ERR:
            self._write_over(r, d_rank, False, f"WRITE to {peer.engine_id} rank {d_rank} failed")

    def _write_over(self, r: _Rendezvous, d_rank: int, ok: bool, error: str | None) -> None:
        """Nothing more can land in D rank d_rank's blocks: tell it how it ended; P's blocks are freed once every
        D rank's part is over (_maybe_finish)."""
        x = r.dests[d_rank]
        reg = x.write_reg
        assert reg is not None and r.send is not None
        if ok and x.xfer is not None:
            r.num_bytes += x.xfer.num_bytes
            secs = time.monotonic() - x.posted_at
            r.seconds = secs if r.seconds is None else max(r.seconds, secs)
        x.write_reg, x.xfer = None, None
        attempt = reg.msg.attempt
        x.ended = (attempt, f"the KV was already written for attempt {attempt}") if ok else (-1, f"{error}")
        if not ok:
            log.warning("push %s attempt %d, D rank %d: %s", r.transfer_id, attempt, d_rank, error)
        if x.reg is not None:  # a newer attempt arrived during the write: this rank's part is over all the same
            self._fail(x.reg.peer, r.transfer_id, x.reg.msg.attempt, x.ended[1])
            x.reg = None
        if x.cancel_asked:
            self._notify(reg.peer.agent_name, PushCancelAck(r.transfer_id, attempt, self._rank, ok))
        elif error is not None:
            self._fail(reg.peer, r.transfer_id, attempt, error)
        if not ok:  # the request cannot run on D: refuse its other ranks now, free P's blocks when nothing is in flight
            self._give_up(r, SendOutcome.FAILED, f"the transfer failed: {error}")
        else:
            self._maybe_finish(r)

    def _done(self, r: _Rendezvous, why: str) -> None:
        """This transfer id will never be written (again): refuse what is pending and what comes later."""
        for x in r.dests.values():
            if x.reg is not None:
                self._fail(x.reg.peer, r.transfer_id, x.reg.msg.attempt, why)
                x.reg = None
        self.rv.pop(r.transfer_id, None)
        written = {d: x.ended[0] for d, x in r.dests.items() if x.ended is not None and x.ended[0] >= 0}
        self.finished[r.transfer_id] = (written, why)
        while len(self.finished) > MAX_FINISHED_IDS:
            self.finished.popitem(last=False)

    # ---- notifications to D -----------------------------------------------------------------------------------------
    def _fail(self, peer: Peer, tid: str, attempt: int, reason: str) -> None:
        self._notify(peer.agent_name, PushFail(tid, attempt, reason))

    def _notify(self, agent_name: str, msg: Message) -> None:
        if self.ctx.peers.by_agent(agent_name) is None:
            return  # forgotten (dead): nothing to tell
        try:
            self.ctx.agent.send_notif(agent_name, encode(msg))
        except AgentError as e:
            log.warning("push: could not send %s to %s: %s", type(msg).__name__, agent_name, e)
