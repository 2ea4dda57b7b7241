"""Push, prefill side, as D's ranks see it (transfer thread): their registrations and cancels, P's keepalives
while it works on the prefill, and how a rendezvous ends. SendSide (push_send.py) builds on this with P's own
requests and the WRITEs; the module docstring there tells the whole story.

A registration carries an attempt number and only a rank's newest attempt is ever written (older ones get
PushFail). One P is expected to produce (StepMeta.expected) waits as long as P works on it, answered with
PushQueued at once and then every keepalive_ms it asked for; one for a transfer P does not expect and without a
finished prefill is dropped after push_registration_timeout_s (PushFail). A D rank's PushCancel is answered
with PushCancelAck once nothing more can land in its blocks for that attempt; a D that gave the transfer up
(or refused the request) frees P's blocks as soon as no WRITE is in flight.
"""

from __future__ import annotations

import abc
import logging
import time

from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.give_back import REFUSED
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.push_rendezvous import Expected, FinishedTransfers, Registration, Rendezvous
from pdserve.transfer.thread.push_write import notify
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire_notifs import PushCancel, PushCancelAck, PushFail, PushQueued, PushRegister

log = logging.getLogger(__name__)

MIN_KEEPALIVE_S = 0.05  # PushQueued goes at most this often per registration, whatever D asks for


class DestSide(abc.ABC):
    """The rendezvous table and D's messages (transfer thread only). A subclass (push_send.SendSide) provides
    _write: post the WRITE for one D rank's newest registration once the prefill is there, and _prepare: lay it
    out before that."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.rv: dict[str, Rendezvous] = {}
        self.finished = FinishedTransfers()  # transfer ids over: late messages for them are refused
        self.producers = Expected()  # the transfer ids P's queued or running requests produce

    @abc.abstractmethod
    def _write(self, r: Rendezvous, d_rank: int) -> None: ...

    @abc.abstractmethod
    def _prepare(self, r: Rendezvous, d_rank: int) -> None:
        """D rank d_rank registered while P works on the prefill: lay its WRITE out now if P's blocks are known."""

    # ---- how a rendezvous ends --------------------------------------------------------------------------------------
    def _give_up(self, r: Rendezvous, outcome: SendOutcome, why: str) -> None:
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

    def _maybe_finish(self, r: Rendezvous) -> None:
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
        r = self.rv.setdefault(tid, Rendezvous(tid))
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
        r.given_up = None  # a newer attempt: D wants the KV after all
        if x.reg is not None:
            self._fail(x.reg.peer, tid, x.reg.msg.attempt, f"superseded by attempt {msg.attempt}")
        reg = x.reg = Registration(msg, peer, time.time())
        timeout = self.ctx.cfg.push_registration_timeout_s
        self.ctx.thread.call_at(now + timeout, lambda: self._expire_reg(tid, d_rank, reg))
        if r.send is not None:
            self.ctx.sink.event(r.send.request_id, "registration_received", reg.received_at)
            if not x.writing:
                self._write(r, d_rank)
        elif tid in self.producers:
            self._start_keepalive(tid, d_rank, reg)
            self._prepare(r, d_rank)

    def _expire_reg(self, tid: str, d_rank: int, reg: Registration) -> None:
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

    def _start_keepalive(self, tid: str, d_rank: int, reg: Registration) -> None:
        if not reg.keepalive_on:
            reg.keepalive_on = True
            self._keepalive(tid, d_rank, reg)

    def _keepalive(self, tid: str, d_rank: int, reg: Registration) -> None:
        """PushQueued to D's rank now and every keepalive_ms, while reg waits for a prefill P is working on."""
        r = self.rv.get(tid)
        x = r.dests.get(d_rank) if r is not None else None
        if x is None or x.reg is not reg or tid not in self.producers:
            reg.keepalive_on = False  # written, superseded, cancelled, failed, or no longer expected
            return
        notify(self.ctx, reg.peer.agent_name, PushQueued(tid, reg.msg.attempt))
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
        if not landed and attempt >= (x.max_attempt if x is not None else REFUSED):
            # that D rank gave its newest attempt up (timeout, abort) or refused the request before registering
            self._consumer_gave_up(tid, attempt == REFUSED)
        if attempt != REFUSED:  # a refusal waits for no answer
            notify(self.ctx, sender, PushCancelAck(tid, attempt, self.ctx.spec.tp_rank, landed))

    def _consumer_gave_up(self, tid: str, refused: bool) -> None:
        """D gave the transfer up: free the finished prefill now (once a WRITE to another D rank is over), or, still
        queued or running here, as soon as it is handed over unless a D rank registers a newer attempt first. A
        refusal of a transfer P has not heard of yet (both legs leave the router at once) ends it: its prefill is
        freed on arrival."""
        why = "the decode instance refused the request" if refused else "the decode instance gave the transfer up"
        r = self.rv.get(tid)
        if r is not None and (r.send is not None or r.writing):
            log.info("push: transfer %s: %s; freeing its blocks", tid, why)
            self._give_up(r, SendOutcome.FAILED, why)
        elif tid in self.producers:
            self.rv.setdefault(tid, Rendezvous(tid)).given_up = why
        elif refused and tid not in self.finished:
            log.info("push: transfer %s: %s before this instance had its prefill", tid, why)
            self._done(r or Rendezvous(tid), why)

    def _done(self, r: Rendezvous, why: str) -> None:
        """This transfer id will never be written (again): refuse what is pending and what comes later."""
        for x in r.dests.values():
            if x.reg is not None:
                self._fail(x.reg.peer, r.transfer_id, x.reg.msg.attempt, why)
                x.reg = None
        self.rv.pop(r.transfer_id, None)
        written = {d: x.ended[0] for d, x in r.dests.items() if x.ended is not None and x.ended[0] >= 0}
        self.finished.add(r.transfer_id, written, why)

    # ---- notifications to D -----------------------------------------------------------------------------------------
    def _fail(self, peer: Peer, tid: str, attempt: int, reason: str) -> None:
        notify(self.ctx, peer.agent_name, PushFail(tid, attempt, reason))
