"""Push, prefill side (transfer thread): the rendezvous of D's registration and P's finished prefill.

Both arrive in either order, keyed by transfer_id; each rank of D registers on its own (its agent, its blocks),
so a rendezvous holds one part per D rank (push_rendezvous.py: DestPart, keyed by the rank from D's handshake).
D's registrations and cancels, the keepalives and how a rendezvous ends are push_dests.py's (DestSide, which
SendSide extends). A registration carries an attempt number and only a rank's newest attempt is ever written
(older ones get PushFail). Whichever arrives second triggers one WRITE (push_write.py) of the heads that D rank
takes from this P rank (heads.py; none: the part ends silently), carrying a PushDone, which NIXL delivers after
the data; when P's blocks are known before its prefill ends (StepMeta.planned), a registration's WRITE is laid out
then and only posted at the end (push_prepare.py). P's blocks are handed back (finished_sends) when every D
rank's part is over (D's TP size comes from its handshake), never while a WRITE is in flight; a failed part
refuses the other D ranks at once (the request cannot run on D) and the blocks go as soon as nothing is in
flight.

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

from pdserve.transfer.base import SendTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.layout import LayoutError
from pdserve.transfer.thread.agent import AgentError
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.push_dests import DestSide
from pdserve.transfer.thread.push_prepare import PreparedWrite, PreparedWrites, lay_out
from pdserve.transfer.thread.push_rendezvous import Rendezvous
from pdserve.transfer.thread.push_write import WriteOver, check_write, notify, post_write
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire_notifs import PushCancelAck

log = logging.getLogger(__name__)

ABANDONED = "the prefill request was aborted on the prefill instance"


class SendSide(DestSide):
    """P's push side: its own requests (expected, abandoned, handed over, released, expired) and the WRITEs;
    D's registrations and cancels are DestSide's (push_dests.py)."""

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self.planned: dict[str, SendTask] = {}  # transfer id -> the blocks its prefill will hand over (on_plan)
        # the WRITEs prepared and not yet posted; their number goes to the sink when it changes
        self.prepared_writes = PreparedWrites(lambda n: ctx.sink.prepared_writes(n))

    # ---- P's own requests: expected at arrival, then exactly one send or abandon ------------------------------------
    def on_expect(self, request_id: str, tid: str, now: float) -> None:
        if (fin := self.finished.get(tid)) is not None:  # its send is freed at once (_add_send)
            log.info("push: request %s produces transfer %s, which is already over (%s)", request_id, tid, fin[1])
            return
        self.producers.add(request_id, tid)
        r = self.rv.get(tid)
        for d_rank, x in r.dests.items() if r is not None else ():
            if x.reg is not None:  # D registered before P's request arrived: tell D now
                self._start_keepalive(tid, d_rank, x.reg)

    def on_abandon(self, request_id: str) -> None:
        tid = self.producers.remove(request_id)
        if tid is None or tid in self.producers:
            return  # not expected, or another request of P still produces this transfer
        self.planned.pop(tid, None)
        r = self.rv.get(tid)
        if r is not None and (r.send is not None or r.writing):
            return  # another prefill was handed over for it: that one is written
        log.info("push: transfer %s abandoned (request %s aborted)", tid, request_id)
        self._done(r or Rendezvous(tid), ABANDONED)  # pending registrations get PushFail now

    # ---- P's blocks known before the prefill ends: the WRITEs laid out (push_prepare.py) -----------------------------
    def on_plan(self, task: SendTask) -> None:
        """The prompt's last chunk of a request producing task.transfer_id was scheduled: its blocks are task's.
        Prepare the WRITE of every D rank registered so far; later registrations are prepared as they come."""
        tid = task.transfer_id
        assert tid is not None
        if tid not in self.producers or tid in self.finished:
            return  # abandoned meanwhile (the step's abandons come after it), or over
        self.planned[tid] = task
        r = self.rv.get(tid)
        if r is not None and r.send is None:
            for d_rank in list(r.dests):
                self._prepare(r, d_rank)

    def _prepare(self, r: Rendezvous, d_rank: int) -> None:
        """Lay out D rank d_rank's WRITE of its newest registration from the planned blocks, while P computes."""
        x, plan = r.dests[d_rank], self.planned.get(r.transfer_id)
        reg = x.reg
        if plan is None or reg is None or x.writing or r.send is not None:
            return
        if x.prepared is not None:
            return  # prepared for reg already (DestPart.reg releases it when reg changes)
        msg = reg.msg
        try:
            if msg.start_token + msg.num_tokens > plan.num_tokens:
                return  # the post refuses it, with the finished prefill's numbers
            layout = lay_out(self.ctx, plan.tables, msg, reg.peer, lambda _: None)
        except LayoutError:
            return  # refused at the post, with its reason
        request = None
        if layout.heads is not None and msg.num_tokens > 0:
            try:
                request = self.ctx.agent.prepare("WRITE", layout.local, layout.remote, reg.peer.agent_name,
                                                 reg.peer.info.memory)  # fmt: skip
            except AgentError as e:  # posted from the layout's rows at the prefill's end, failing there if it must
                log.info("push %s: could not prepare the WRITE to D rank %d: %s", r.transfer_id, d_rank, e)
        x.prepared = self.prepared_writes.add(
            PreparedWrite(reg, msg.start_token + msg.num_tokens, layout, request, self.prepared_writes.forget)
        )
        self.ctx.sink.event(plan.request_id, "write_prepared")

    # ---- the finished prefill ---------------------------------------------------------------------------------------
    def on_send(self, task: SendTask, now: float) -> None:
        self.ctx.faults.defer(FaultPoint.SEND_READY, self.ctx.thread.call_at,
                              lambda: self._add_send(task, time.monotonic()))  # fmt: skip

    def _add_send(self, task: SendTask, now: float) -> None:
        tid = task.transfer_id
        assert tid is not None  # the push scheduler half sends only tasks with a transfer id
        self.producers.remove(task.request_id)
        self.planned.pop(tid, None)  # the WRITEs prepared from it stay with their registrations
        r = self.rv.get(tid) or Rendezvous(tid)
        if (fin := self.finished.get(tid)) is not None and r.send is None and not r.writing:
            log.info("push: transfer %s is over (%s); freeing request %s's prefill", tid, fin[1], task.request_id)
            self.ctx.sink.send_finished(task.request_id, SendOutcome.FAILED)
            return
        if r.send is not None or r.writing or tid in self.finished:
            log.warning("push: a second prefill for transfer %s (request %s); freeing it", tid, task.request_id)
            self.ctx.sink.send_finished(task.request_id, SendOutcome.FAILED)
            return
        self.rv[tid] = r
        r.send = task
        self.ctx.thread.call_at(now + self.ctx.cfg.lease_s, lambda: self._expire_send(tid, task))
        if r.given_up is not None:  # D gave up while P computed it, and registered nothing newer since
            log.info("push: transfer %s: %s; freeing request %s's prefill", tid, r.given_up, task.request_id)
            self._give_up(r, SendOutcome.FAILED, r.given_up)
            return
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

    # ---- the write (push_write.py) ----------------------------------------------------------------------------------
    def _write(self, r: Rendezvous, d_rank: int) -> None:
        """Write D rank d_rank's newest registration: the heads it takes from this P rank, with one PushDone."""
        x = r.dests[d_rank]
        reg, send = x.reg, r.send
        assert reg is not None and send is not None
        prepared = x.take_prepared()  # (before reg is cleared, which would release it)
        x.reg, x.write_reg, x.cancel_asked = None, reg, False
        self._over(r, d_rank, post_write(self.ctx, r.transfer_id, send, x, d_rank, prepared))

    def progress(self, now: float) -> bool:
        hot = False
        for r in list(self.rv.values()):
            for d_rank, x in list(r.dests.items()):
                if x.writing:
                    self._over(r, d_rank, check_write(self.ctx, x, d_rank))
            hot = hot or r.send is not None  # writing, or waiting for a rank of D to register: poll fast
        return hot

    def in_flight(self) -> bool:
        return any(x.xfer is not None for r in self.rv.values() for x in r.dests.values())

    def _over(self, r: Rendezvous, d_rank: int, over: WriteOver | None) -> None:
        if over is not None:  # else the WRITE is in flight
            self._write_over(r, d_rank, over.ok, over.error)

    def _write_over(self, r: Rendezvous, d_rank: int, ok: bool, error: str | None) -> None:
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
            notify(self.ctx, reg.peer.agent_name, PushCancelAck(r.transfer_id, attempt, self.ctx.spec.tp_rank, ok))
        elif error is not None:
            self._fail(reg.peer, r.transfer_id, attempt, error)
        if not ok:  # the request cannot run on D: refuse its other ranks now, free P's blocks when nothing is in flight
            self._give_up(r, SendOutcome.FAILED, f"the transfer failed: {error}")
        else:
            self._maybe_finish(r)
