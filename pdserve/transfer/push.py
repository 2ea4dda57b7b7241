"""Push mode: D registers its blocks while P computes; P's transfer thread WRITEs when both are ready
(DESIGN.md, "Push"). The scheduler half is here; the transfer-thread halves are push_send.py (P) and
push_recv.py (D), joined by PushCore, which routes each StepMeta part and notification to its side.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from pdserve.transfer.base import ConnectorScheduler, RecvTask, SendTask, StepMeta
from pdserve.transfer.params import KVTransferParams, PullSource, PushAnswer, PushSource, Refusal, RemoteDecode
from pdserve.transfer.push_recv import RecvSide
from pdserve.transfer.push_send import SendSide
from pdserve.transfer.scheduler_base import SchedulerBase
from pdserve.transfer.wire import Message, PushCancel, PushCancelAck, PushDone, PushFail, PushQueued, PushRegister
from pdserve.transfer.worker import NixlWorker, TransferContext

log = logging.getLogger(__name__)

MAX_ATTEMPT_IDS = 65536  # transfer ids whose attempt counter D remembers


class PushScheduler(SchedulerBase, ConnectorScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attempts: OrderedDict[str, int] = OrderedDict()  # D: transfer id -> last attempt number
        self._producing: dict[str, str] = {}  # P: request id -> transfer id, from arrival until finish or abort

    def needs_remote_kv(self, request_id: str, params: KVTransferParams | None) -> bool:
        # P: tell the transfer thread at arrival, so a registration for a queued prefill does not time out
        if isinstance(params, RemoteDecode) and params.transfer_id is not None:
            self._producing[request_id] = params.transfer_id
            self.meta.expected.append((request_id, params.transfer_id))
        return super().needs_remote_kv(request_id, params)

    def on_request_aborted(self, request_id: str) -> None:
        super().on_request_aborted(request_id)
        if self._producing.pop(request_id, None) is not None:
            self.meta.abandoned.append(request_id)

    def recv_task(
        self, request_id: str, block_ids: tuple[int, ...], start: int, num_tokens: int, source: PullSource | PushSource
    ) -> RecvTask:
        # every allocation for a transfer id is a new attempt: data for an older one never lands in these blocks
        tid = source.transfer_id if isinstance(source, PushSource) else ""
        attempt = self._attempts.pop(tid, -1) + 1
        self._attempts[tid] = attempt
        while len(self._attempts) > MAX_ATTEMPT_IDS:
            self._attempts.popitem(last=False)
        return RecvTask(request_id, block_ids, start, num_tokens, source, attempt)

    def on_request_finished(
        self, request_id: str, block_ids: list[int], num_tokens: int, params: KVTransferParams | None
    ) -> bool:
        self._producing.pop(request_id, None)  # ends as the SendTask below (same transfer id)
        if not isinstance(params, RemoteDecode):
            return False
        if params.transfer_id is None:
            log.warning("push: request %s has do_remote_decode but no transfer_id; not pinned", request_id)
            self._answers[request_id] = Refusal("push mode needs a transfer_id in kv_transfer_params")
            return False
        self.meta.sends.append(SendTask(request_id, tuple(block_ids), num_tokens, params.transfer_id))
        self._answers[request_id] = PushAnswer(params.transfer_id, self.cfg.engine_id)
        return True


class PushCore:
    """Both push halves on the transfer thread (an instance may be a producer and a consumer at once)."""

    def __init__(self, ctx: TransferContext) -> None:
        self.send = SendSide(ctx)
        self.recv = RecvSide(ctx)

    def on_step(self, meta: StepMeta, now: float) -> None:
        for rid, tid in meta.expected:  # before sends and abandons: a request may end in its arrival step
            self.send.on_expect(rid, tid, now)
        for s in meta.sends:
            self.send.on_send(s, now)
        for rid in meta.abandoned:
            self.send.on_abandon(rid)
        for r in meta.recvs:
            self.recv.on_recv(r, now)
        for rid in meta.cancels:
            self.recv.on_cancel(rid)

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
