"""Push mode's scheduler half (engine thread; pure Python): P announces at arrival the transfers it will produce
(StepMeta.expected) and ends each with one SendTask or one abandoned entry; D numbers each allocation for a
transfer id as a new attempt, so data for an older attempt never lands in newer blocks."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdserve.kv.params import KVTransferParams, PullSource, PushAnswer, PushSource, Refusal, RemoteDecode
from pdserve.transfer.base import ConnectorScheduler, RecvTask, SendTask
from pdserve.transfer.scheduler.base import SchedulerBase

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

    def on_prefill_scheduled(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        block_tables: Sequence[Sequence[int]] = (),
    ) -> None:
        # P: the WRITEs are laid out while the prefill runs (thread/push_prepare.py); only the post waits for its end
        tid = self._producing.get(request_id)
        if tid is not None and isinstance(params, RemoteDecode):
            tables = tuple(tuple(t) for t in block_tables)
            self.meta.planned.append(SendTask(request_id, tuple(block_ids), num_tokens, tid, tables))

    def on_request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        token_ids: Sequence[int] = (),
        block_tables: Sequence[Sequence[int]] = (),
    ) -> bool:
        self._producing.pop(request_id, None)  # ends as the SendTask below (same transfer id)
        if not isinstance(params, RemoteDecode):
            return False
        if params.transfer_id is None:
            log.warning("push: request %s has do_remote_decode but no transfer_id; not pinned", request_id)
            self._answers[request_id] = Refusal("push mode needs a transfer_id in kv_transfer_params")
            return False
        tables = tuple(tuple(t) for t in block_tables)
        first = self.first_token(token_ids, num_tokens)  # D's first output token, sent with the WRITE
        self.meta.sends.append(SendTask(request_id, tuple(block_ids), num_tokens, params.transfer_id, tables, first))
        self._answers[request_id] = PushAnswer(params.transfer_id, self.cfg.engine_id)
        return True
