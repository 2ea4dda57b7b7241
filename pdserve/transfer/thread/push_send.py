"""Push, prefill side (transfer thread): the rendezvous of D's registration and P's finished prefill.

Both arrive in either order, keyed by transfer_id; the registration carries an attempt number and only the
newest attempt is ever written (older ones get PushFail). Whichever arrives second triggers one WRITE per
destination (this rank -> D's rank) carrying a PushDone notification, which NIXL delivers after the data.
P's blocks are handed back (finished_sends) when the WRITE is DONE or failed, never while it is in flight.

P's scheduler half says at arrival which transfer ids P will produce (StepMeta.expected) and which of those
ended without a prefill to hand over (StepMeta.abandoned: aborted while queued or running). A registration
for an expected transfer waits as long as P works on it: P answers it with PushQueued at once and then every
keepalive_ms the registration asked for (D's receive clock restarts on each), and with PushFail at once if
the request is abandoned (an abandoned transfer id is remembered: a later registration is refused at once).

Timeouts: a registration for a transfer P does not expect (its prefill leg never arrived, or is not here
yet) and without a finished prefill after push_registration_timeout_s is dropped (PushFail tells D, whose
blocks are then safe); a finished prefill without a registration after lease_s is freed ("expired"). D's
PushCancel is answered with PushCancelAck once nothing more can land for that attempt.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.transfer.base import SendTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.layout import LayoutError, descriptors, group_ranges, group_segments
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
class _Rendezvous:
    transfer_id: str
    send: SendTask | None = None  # the finished prefill (P's blocks), once handed over
    reg: _Reg | None = None  # the newest registration not yet written
    max_attempt: int = -1  # newest attempt seen; older registrations are refused
    write_reg: _Reg | None = None  # the registration being written
    xfer: Xfer | None = None  # the WRITE in flight (None for a zero-token transfer)
    posted_at: float = 0.0
    cancel_asked: bool = False  # D cancelled the attempt being written: ack when the write is over
    silent: bool = False  # this rank sends D's rank no heads (heads.py): nothing written, no PushDone
    events: dict[str, float] = field(default_factory=dict)

    @property
    def writing(self) -> bool:
        return self.write_reg is not None

    @property
    def is_empty(self) -> bool:
        return self.send is None and self.reg is None and not self.writing


class SendSide:
    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.rv: dict[str, _Rendezvous] = {}
        self.finished: OrderedDict[str, tuple[int, str]] = OrderedDict()  # transfer id -> (attempt written, why)
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
        if r is not None and r.reg is not None:  # D registered before P's request arrived: tell D now
            self._start_keepalive(tid, r.reg)

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
        self._done(r or _Rendezvous(tid), -1, ABANDONED)  # a pending registration gets PushFail now

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
        if r.reg is not None:
            self.ctx.sink.event(task.request_id, "registration_received", r.reg.received_at)
            self._write(r)

    def on_release(self, request_id: str) -> None:
        """The engine gives up this finished prefill's pin (abort, POST /kv_transfer/release): free it now, and
        refuse D's registration; a WRITE in flight is let finish (it reads these blocks), then they are freed."""
        for r in list(self.rv.values()):
            if r.send is not None and r.send.request_id == request_id:
                if r.writing:
                    return
                log.info("push: transfer %s released on the prefill instance (request %s)", r.transfer_id, request_id)
                r.send = None
                self.ctx.sink.send_finished(request_id, SendOutcome.FAILED)
                self._done(r, -1, "the prefill instance released the KV (request aborted or its decode leg failed)")
                return

    def _expire_send(self, tid: str, task: SendTask) -> None:
        r = self.rv.get(tid)
        if r is None or r.send is not task or r.writing:
            return
        log.info("push: no registration for %s within %g s; freeing its blocks", tid, self.ctx.cfg.lease_s)
        r.send = None
        self.ctx.sink.send_finished(task.request_id, SendOutcome.EXPIRED)
        self._done(r, -1, "the prefill's KV expired before D registered")

    # ---- D's messages -----------------------------------------------------------------------------------------------
    def on_register(self, sender: str, msg: PushRegister, now: float) -> None:
        peer = self.ctx.peers.by_agent(sender)
        if peer is None:
            log.warning(
                "push: registration for %s from unknown agent %s (no handshake); dropped", msg.transfer_id, sender
            )
            return
        tid = msg.transfer_id
        if (fin := self.finished.get(tid)) is not None:
            self._fail(peer, msg.transfer_id, msg.attempt, fin[1])
            return
        r = self.rv.setdefault(tid, _Rendezvous(tid))
        if msg.attempt <= r.max_attempt:
            self._fail(peer, tid, msg.attempt, f"attempt {msg.attempt} is superseded by attempt {r.max_attempt}")
            return
        r.max_attempt = msg.attempt
        if r.reg is not None:
            self._fail(r.reg.peer, tid, r.reg.msg.attempt, f"superseded by attempt {msg.attempt}")
        reg = r.reg = _Reg(msg, peer, time.time())
        timeout = self.ctx.cfg.push_registration_timeout_s
        self.ctx.thread.call_at(now + timeout, lambda: self._expire_reg(tid, reg))
        if r.send is not None:
            self.ctx.sink.event(r.send.request_id, "registration_received", reg.received_at)
            if not r.writing:
                self._write(r)
        elif tid in self.producers:
            self._start_keepalive(tid, reg)

    def _expire_reg(self, tid: str, reg: _Reg) -> None:
        r = self.rv.get(tid)
        if r is None or r.reg is not reg:
            return
        timeout = self.ctx.cfg.push_registration_timeout_s
        if tid in self.producers:  # P is working on this prefill: the registration waits as long as that takes
            self.ctx.thread.call_at(time.monotonic() + timeout, lambda: self._expire_reg(tid, reg))
            return
        r.reg = None
        why = f"the prefill did not finish within {timeout:g} s (no request for this transfer arrived here)"
        self._fail(reg.peer, tid, reg.msg.attempt, why)
        if r.is_empty:
            del self.rv[tid]

    def _start_keepalive(self, tid: str, reg: _Reg) -> None:
        if not reg.keepalive_on:
            reg.keepalive_on = True
            self._keepalive(tid, reg)

    def _keepalive(self, tid: str, reg: _Reg) -> None:
        """PushQueued to D now and every keepalive_ms, while reg waits for a prefill P is working on."""
        r = self.rv.get(tid)
        if r is None or r.reg is not reg or tid not in self.producers:
            reg.keepalive_on = False  # written, superseded, cancelled, failed, or no longer expected
            return
        self._notify(reg.peer.agent_name, PushQueued(tid, reg.msg.attempt))
        every = max(MIN_KEEPALIVE_S, reg.msg.keepalive_ms / 1000)
        self.ctx.thread.call_at(time.monotonic() + every, lambda: self._keepalive(tid, reg))

    def on_cancel(self, sender: str, msg: PushCancel) -> None:
        tid, attempt = msg.transfer_id, msg.attempt
        r = self.rv.get(tid)
        if r is not None and r.write_reg is not None and r.write_reg.msg.attempt == attempt:
            r.cancel_asked = True  # acked when the write is over
            return
        if r is not None and r.reg is not None and r.reg.msg.attempt == attempt:
            r.reg = None
            if r.is_empty:
                del self.rv[tid]
        fin = self.finished.get(tid)
        self._notify(sender, PushCancelAck(tid, attempt, self._rank, fin is not None and fin[0] == attempt))

    # ---- the write --------------------------------------------------------------------------------------------------
    @property
    def _rank(self) -> int:
        return self.ctx.spec.tp_rank

    def _ranges(self, msg: PushRegister, remote_block_size: int) -> list[tuple[int, int]]:
        """Per KV group, the tokens this WRITE reads (layout.group_ranges)."""
        bs = (self.ctx.layout.block_size, remote_block_size)
        return group_ranges(self.ctx.spec.windows, msg.start_token, msg.num_tokens, *bs)

    def _write(self, r: _Rendezvous) -> None:
        reg, send = r.reg, r.send
        assert reg is not None and send is not None
        r.reg, r.write_reg, r.cancel_asked = None, reg, False
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
            heads = self.ctx.heads_to(peer.info)  # this rank's slice of D's rank's heads (heads.py)
            if heads is not None:
                local, remote = descriptors(self.ctx.layout, peer.layout, segs, heads)
        except LayoutError as e:
            self._write_over(r, SendOutcome.FAILED, f"cannot write: {e}")
            return
        if heads is None:  # D's rank gets its heads from other ranks of P: this rank's part is over, unannounced
            r.silent = True
            self._write_over(r, SendOutcome.OK, None)
            return
        nbytes = int(local[:, 1].sum()) if len(local) else 0
        done = encode(PushDone(r.transfer_id, msg.attempt, self._rank, self.ctx.spec.tp_size, nbytes))
        r.posted_at, posted_wall = time.monotonic(), time.time()  # the post may complete the WRITE
        try:
            if msg.num_tokens == 0:
                self.ctx.agent.send_notif(peer.agent_name, done)
            else:
                if self.ctx.stager is not None:  # KV cache -> host mirror, exactly the blocks this WRITE reads
                    for table, (first, end) in zip(send.tables, self._ranges(msg, peer.layout.block_size), strict=True):
                        self.ctx.stager.stage_out(table, first, end - first)
                r.xfer = self.ctx.post("WRITE", local, remote, peer.agent_name, done, peer.info.memory)
        except (AgentError, RuntimeError) as e:
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(peer)
            self._write_over(r, SendOutcome.FAILED, f"WRITE to {peer.engine_id} not posted: {e}")
            return
        self.ctx.sink.event(send.request_id, "transfer_posted", posted_wall)
        if r.xfer is not None:
            self.ctx.sink.posted(r.xfer.num_descs, r.xfer.post_seconds)
        self._check(r)

    def progress(self, now: float) -> bool:
        hot = False
        for r in list(self.rv.values()):
            if r.writing:
                self._check(r)
            hot = hot or r.writing or (r.send is not None and r.reg is None)  # waiting for D: poll fast
        return hot

    def in_flight(self) -> bool:
        return any(r.xfer is not None for r in self.rv.values())

    def _check(self, r: _Rendezvous) -> None:
        if r.xfer is None:  # zero tokens: the notification was the whole transfer
            self._write_over(r, SendOutcome.OK, None)
            return
        peer = r.write_reg.peer  # type: ignore[union-attr]
        try:
            state = self.ctx.agent.check(r.xfer)
        except PeerGone as e:
            self.ctx.peers.forget(peer)
            self._write_over(r, SendOutcome.FAILED, f"decode instance {peer.engine_id} went away: {e}")
            return
        if state is XferState.DONE:
            self._write_over(r, SendOutcome.OK, None)
        elif state is XferState.ERR:
            self._write_over(r, SendOutcome.FAILED, f"WRITE to {peer.engine_id} failed")

    def _write_over(self, r: _Rendezvous, outcome: SendOutcome, error: str | None) -> None:
        """Nothing more can land in D's blocks: free P's blocks and tell D how it ended."""
        reg, send = r.write_reg, r.send
        assert reg is not None and send is not None
        ok = outcome is SendOutcome.OK
        nbytes = r.xfer.num_bytes if r.xfer is not None and ok else 0
        secs = time.monotonic() - r.posted_at if r.xfer is not None and ok else None
        r.write_reg, r.xfer, r.send = None, None, None
        if ok and not r.silent:
            self.ctx.sink.event(send.request_id, "transfer_done")
        else:
            log.warning("push %s attempt %d: %s", r.transfer_id, reg.msg.attempt, error)
        self.ctx.sink.send_finished(send.request_id, outcome, nbytes, secs)
        attempt = reg.msg.attempt
        if r.cancel_asked:
            self._notify(reg.peer.agent_name, PushCancelAck(r.transfer_id, attempt, self._rank, ok))
        elif error is not None:
            self._fail(reg.peer, r.transfer_id, attempt, error)
        self._done(r, attempt if ok else -1, f"the KV was already written for attempt {attempt}"
                   if ok else f"the transfer failed: {error}")  # fmt: skip

    def _done(self, r: _Rendezvous, attempt: int, why: str) -> None:
        """This transfer id will never be written (again): refuse what is pending and what comes later."""
        if r.reg is not None:
            self._fail(r.reg.peer, r.transfer_id, r.reg.msg.attempt, why)
            r.reg = None
        self.rv.pop(r.transfer_id, None)
        self.finished[r.transfer_id] = (attempt, why)
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
