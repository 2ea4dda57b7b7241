"""What pull's and push's ConnectorScheduler halves share (engine thread only; no I/O, no torch)."""

from __future__ import annotations

from typing import Any

from pdserve.config import TransferConfig
from pdserve.transfer.base import RecvTask, StepMeta


class SchedulerBase:
    """D side bookkeeping and the per-step StepMeta; subclasses add on_request_finished (P side)."""

    def __init__(self, cfg: TransferConfig, block_size: int, host: str, port: int, tp_size: int = 1) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.host = host  # side channel address peers dial (the bound port, also when 0 was asked for)
        self.port = port
        self.tp_size = tp_size
        self.meta = StepMeta()  # what the next build_step_meta() hands over
        self._params: dict[str, dict[str, Any]] = {}  # D: request id -> kv_transfer_params until allocation

    def needs_remote_kv(self, request_id: str, params: dict[str, Any] | None) -> bool:
        if params and params.get("do_remote_prefill"):
            self._params[request_id] = dict(params)
            return True
        return False

    def on_blocks_allocated(
        self, request_id: str, block_ids: list[int], num_local_tokens: int, num_prompt_tokens: int
    ) -> None:
        params = self._params.pop(request_id, None)
        if params is None:
            raise RuntimeError(f"on_blocks_allocated({request_id!r}) without needs_remote_kv() returning True")
        # D computes the last prompt token itself (and samples the first output token from its logits)
        num_tokens = max(0, num_prompt_tokens - 1 - num_local_tokens)
        self.meta.recvs.append(self.recv_task(request_id, tuple(block_ids), num_local_tokens, num_tokens, params))

    def recv_task(
        self, request_id: str, block_ids: tuple[int, ...], start: int, num_tokens: int, params: dict[str, Any]
    ) -> RecvTask:
        return RecvTask(request_id, block_ids, start, num_tokens, params)

    def on_recv_aborted(self, request_id: str) -> None:
        if self._params.pop(request_id, None) is not None:
            return  # blocks were never allocated: nothing to cancel, and no result will follow
        self.meta.cancels.append(request_id)

    def on_request_aborted(self, request_id: str) -> None:
        self.forget(request_id)  # D: aborted before its blocks were allocated

    def forget(self, request_id: str) -> None:
        self._params.pop(request_id, None)

    def build_step_meta(self) -> StepMeta:
        meta, self.meta = self.meta, StepMeta()
        return meta

    def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.cfg.engine_id,
            "side_channel_host": self.host,
            "side_channel_port": self.port,
            "tp_size": self.tp_size,
            "block_size": self.block_size,
            "transfer_mode": self.cfg.mode,
            "kv_role": self.cfg.role,
        }
