"""Pull mode's scheduler half (engine thread; pure Python): P pins a finished request's blocks and answers with
their coordinates (a PullSource, relayed by the router to D); D's recvs come from SchedulerBase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.kv.capability import KVAuth
from pdserve.kv.params import KVTransferParams, PullSource, RemoteDecode
from pdserve.transfer.base import ConnectorScheduler, SendTask
from pdserve.transfer.scheduler.base import SchedulerBase


class PullScheduler(SchedulerBase, ConnectorScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._auth = KVAuth(self.cfg.auth_secret)  # signs answers; expires with the lease (the blocks' life)

    def on_request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        token_ids: Sequence[int] = (),
        block_tables: Sequence[Sequence[int]] = (),
    ) -> bool:
        if not isinstance(params, RemoteDecode):
            return False
        tables = tuple(tuple(t) for t in block_tables)
        first = self.first_token(token_ids, num_tokens)  # D's first output token, in the answer D gets
        send = SendTask(request_id, tuple(block_ids), num_tokens, block_tables=tables, first_token_id=first)
        self.meta.sends.append(send)
        source = PullSource(
            self.host, self.port, self.cfg.engine_id, request_id, send.pin_ids, num_tokens, self.block_size,
            self.tp_size, block_tables=tables, first_token_id=first,
        )  # fmt: skip
        self._answers[request_id] = self._auth.issue_pull(source, token_ids, self.cfg.lease_s)
        return True
