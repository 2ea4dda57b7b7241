"""What pull's and push's ConnectorScheduler halves share (engine thread only; no I/O, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.config import TransferConfig
from pdserve.kv.groups import KVGroups
from pdserve.kv.params import KVAnswer, KVTransferParams, PullSource, PushSource
from pdserve.transfer.base import RecvTask, StepMeta


class SchedulerBase:
    """D side: the RecvTask of an allocated request; the per-step StepMeta; P's answers until asked for.
    Subclasses add on_request_finished (P side)."""

    def __init__(
        self, cfg: TransferConfig, block_size: int, host: str, port: int, tp_size: int = 1,
        rank_ports: tuple[int, ...] = (), kv_groups: KVGroups | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.block_size = block_size
        self.host = host  # side channel address peers dial (the bound port, also when 0 was asked for)
        self.port = port
        self.tp_size = tp_size
        self.rank_ports = (port, *rank_ports) if tp_size > 1 else ()  # every rank's side channel, on host
        self.kv_groups = kv_groups or KVGroups.of((), 1)  # the model's KV layer groups (for /kv_transfer/info)
        self.meta = StepMeta()  # what the next build_step_meta() hands over
        self._answers: dict[str, KVAnswer] = {}  # P: request id -> its response's params, until take_answer()

    def needs_remote_kv(self, request_id: str, params: KVTransferParams | None) -> bool:
        # params of the other mode are a deployment's mistake, not the client's: the transfer thread fails
        # the recv (a 500 naming both modes; the router's 502), as for any recv that cannot be served
        return isinstance(params, PullSource | PushSource)

    def on_blocks_allocated(
        self,
        request_id: str,
        block_ids: list[int],
        num_local_tokens: int,
        num_prompt_tokens: int,
        source: PullSource | PushSource,
        block_tables: Sequence[Sequence[int]] = (),
        with_last_token: bool = False,
    ) -> None:
        # with_last_token: the whole prompt (the prefill's first token comes along); else D computes the last
        # prompt token itself (and samples the first output token from its logits)
        num_tokens = max(0, num_prompt_tokens - (0 if with_last_token else 1) - num_local_tokens)
        task = self.recv_task(request_id, tuple(block_ids), num_local_tokens, num_tokens, source)
        self.meta.recvs.append(replace(task, block_tables=tuple(tuple(t) for t in block_tables)))

    def recv_task(
        self, request_id: str, block_ids: tuple[int, ...], start: int, num_tokens: int, source: PullSource | PushSource
    ) -> RecvTask:
        return RecvTask(request_id, block_ids, start, num_tokens, source)

    def on_refused(self, source: PullSource | PushSource) -> None:
        self.meta.refusals.append(source)

    def on_recv_aborted(self, request_id: str) -> None:
        self.meta.cancels.append(request_id)  # blocks were allocated (the request was parked): a result follows

    def on_request_aborted(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def on_pin_released(self, request_id: str) -> None:
        self._answers.pop(request_id, None)
        self.meta.releases.append(request_id)

    @staticmethod
    def first_token(token_ids: Sequence[int], num_tokens: int) -> int | None:
        """P: the token sampled after the num_tokens tokens whose KV the blocks hold (None: none yet)."""
        return token_ids[num_tokens] if len(token_ids) > num_tokens else None

    def take_answer(self, request_id: str) -> KVAnswer | None:
        return self._answers.pop(request_id, None)

    def build_step_meta(self) -> StepMeta:
        meta, self.meta = self.meta, StepMeta()
        return meta

    def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.cfg.engine_id,
            "side_channel_host": self.host,
            "side_channel_port": self.port,
            "tp_size": self.tp_size,
            "side_channel_ports": list(self.rank_ports) or [self.port],  # rank r's side channel, on host
            "block_size": self.block_size,
            "transfer_mode": self.cfg.mode,
            "kv_role": self.cfg.role,
            "kv_groups": self.kv_groups.describe(),  # per group: window (None: whole context) and layers
        }
