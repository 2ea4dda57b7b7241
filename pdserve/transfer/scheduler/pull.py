"""Pull mode's scheduler half (engine thread; pure Python): P pins a finished request's blocks and answers with
their coordinates (a PullSource, relayed by the router to D); D's recvs come from SchedulerBase."""

from __future__ import annotations

from pdserve.transfer.base import ConnectorScheduler, SendTask
from pdserve.transfer.params import KVTransferParams, PullSource, RemoteDecode
from pdserve.transfer.scheduler.base import SchedulerBase


class PullScheduler(SchedulerBase, ConnectorScheduler):
    def on_request_finished(
        self, request_id: str, block_ids: list[int], num_tokens: int, params: KVTransferParams | None
    ) -> bool:
        if not isinstance(params, RemoteDecode):
            return False
        self.meta.sends.append(SendTask(request_id, tuple(block_ids), num_tokens))
        self._answers[request_id] = PullSource(
            self.host, self.port, self.cfg.engine_id, request_id, tuple(block_ids), num_tokens, self.block_size,
            self.tp_size,
        )  # fmt: skip
        return True
