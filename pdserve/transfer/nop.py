"""Connectors for kv_role "both" (colocated serving): nothing is transferred, nothing is pinned."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kv.params import KVAnswer, KVTransferParams, PullSource, PushSource
from pdserve.transfer.base import (
    ConnectorScheduler,
    ConnectorWorker,
    KVCacheSpec,
    StepMeta,
    TransferResults,
    TransferStats,
)


class NopScheduler(ConnectorScheduler):
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def needs_remote_kv(self, request_id: str, params: KVTransferParams | None) -> bool:
        return False

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
        raise RuntimeError("a colocated instance never waits for remote KV")

    def on_request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        params: KVTransferParams | None,
        token_ids: Sequence[int] = (),
        block_tables: Sequence[Sequence[int]] = (),
    ) -> bool:
        return False

    def take_answer(self, request_id: str) -> KVAnswer | None:
        return None

    def on_request_aborted(self, request_id: str) -> None:
        pass

    def on_pin_released(self, request_id: str) -> None:
        pass  # nothing is ever pinned

    def on_refused(self, source: PullSource | PushSource) -> None:
        pass  # no transfer layer to tell the producer: its lease frees the KV

    def on_recv_aborted(self, request_id: str) -> None:
        raise RuntimeError("a colocated instance never waits for remote KV")

    def build_step_meta(self) -> StepMeta:
        return StepMeta()

    def info(self) -> dict[str, Any]:
        return {"kv_role": "both", "transfer_mode": None, "block_size": self.block_size, "tp_size": 1}


class NopWorker(ConnectorWorker):
    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        pass

    def start(self, wakeup: Callable[[], None]) -> None:
        pass

    def submit(self, meta: StepMeta) -> None:
        pass

    def poll_results(self) -> TransferResults:
        return TransferResults()

    def stats(self) -> TransferStats:
        return TransferStats()

    def shutdown(self) -> None:
        pass
