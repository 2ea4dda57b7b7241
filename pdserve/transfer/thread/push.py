"""Push mode on the transfer thread: D registers its blocks while P computes; P WRITEs when both are ready
(docs/architecture.md). The halves are push_send.py (P) and push_recv.py (D; one recv's state is push_wait.py's),
joined by PushCore, which routes each StepMeta part and notification to its side. The scheduler half is
scheduler/push.py.
"""

from __future__ import annotations

import logging

from pdserve.transfer.base import StepMeta
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.give_back import give_back
from pdserve.transfer.thread.push_recv import RecvSide
from pdserve.transfer.thread.push_send import SendSide
from pdserve.transfer.thread.worker import NixlWorker
from pdserve.transfer.wire import Message
from pdserve.transfer.wire_notifs import PushCancel, PushCancelAck, PushDone, PushFail, PushQueued, PushRegister

log = logging.getLogger(__name__)


class PushCore:
    """Both push halves on the transfer thread (an instance may be a producer and a consumer at once)."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.send = SendSide(ctx)
        self.recv = RecvSide(ctx)

    def on_step(self, meta: StepMeta, now: float) -> None:
        for rid, tid in meta.expected:  # before sends and abandons: a request may end in its arrival step
            self.send.on_expect(rid, tid, now)
        for s in meta.planned:  # after expected (it names an expected request), before its send
            self.send.on_plan(s)
        for s in meta.sends:
            self.send.on_send(s, now)
        for rid in meta.abandoned:
            self.send.on_abandon(rid)
        for rid in meta.releases:
            self.send.on_release(rid)
        for r in meta.recvs:
            self.recv.on_recv(r, now)
        for rid in meta.cancels:
            self.recv.on_cancel(rid)
        for source in meta.refusals:  # D refused these before registering: P gives the transfers up now
            give_back(self.ctx, source)

    def on_notif(self, sender: str, msg: Message, now: float) -> None:
        if isinstance(msg, PushRegister):
            self.send.on_register(sender, msg, now)
        elif isinstance(msg, PushCancel):
            self.send.on_cancel(sender, msg)
        elif isinstance(msg, PushDone):
            self.recv.on_done(msg)
        elif isinstance(msg, PushFail):
            self.recv.on_fail(msg)
        elif isinstance(msg, PushQueued):
            self.recv.on_queued(msg, now)
        elif isinstance(msg, PushCancelAck):
            self.recv.on_ack(msg)
        else:
            log.warning("push: ignoring %s from %s", type(msg).__name__, sender)

    def progress(self, now: float) -> bool:
        hot_send = self.send.progress(now)
        return self.recv.progress(now) or hot_send

    def in_flight(self) -> bool:
        return self.send.in_flight()


class PushWorker(NixlWorker):
    def make_core(self, ctx: TransferContext) -> PushCore:
        return PushCore(ctx)
