"""What a mode's transfer-thread core works with (TransferContext) and what it offers (ModeCore: the loop's
Core plus the engine's step metadata and the peers' notifications)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pdserve.config import TransferConfig
from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer.base import KVCacheSpec, StepMeta
from pdserve.transfer.checksum import KVChecksum
from pdserve.transfer.faults import NO_FAULTS, Faults
from pdserve.transfer.heads import sources
from pdserve.transfer.layout import Heads
from pdserve.transfer.staging import Stager
from pdserve.transfer.thread.agent import AgentError, NixlAgent, Prepared, Xfer
from pdserve.transfer.thread.handshake import SideChannel
from pdserve.transfer.thread.loop import Core, TransferLoop
from pdserve.transfer.thread.peers import Peers
from pdserve.transfer.thread.results import ResultSink
from pdserve.transfer.wire import Message, PeerInfo


@dataclass
class TransferContext:
    """Everything here is used on the transfer thread only, except sink, thread.post/call and side.request,
    which are thread-safe. Built once, complete, by NixlWorker.register_kv_cache()."""

    cfg: TransferConfig
    spec: KVCacheSpec  # this instance's KV cache (the registered buffer: the host mirror when staged)
    agent: NixlAgent
    local: PeerInfo  # this instance's handshake payload
    side: SideChannel
    thread: TransferLoop
    sink: ResultSink
    peers: Peers
    stager: Stager | None = None  # kv_buffer_device "cpu" with a CUDA cache: NIXL moves a host mirror (staging.py)
    checksum: KVChecksum | None = None  # --kv-checksum: sums over the registered buffer (checksum.py, kv_verify.py)
    faults: Faults = NO_FAULTS  # a test's (faults.py), given to the connector factory; NO_FAULTS in production

    @property
    def geometry(self) -> CacheGeometry:
        return self.spec.geometry

    def heads_from(self, producer: PeerInfo) -> dict[int, Heads]:
        """Consumer side: producer rank -> the head slice this rank receives from it (heads.py); ranks missing
        send this rank nothing."""
        out: dict[int, Heads] = {}
        for s in sources(self.geometry.total_kv_heads, producer.tp_size, self.spec.tp_size, self.spec.tp_rank):
            out[s.producer_rank] = Heads(s.consumer_offset, s.producer_offset, s.num_heads)
        return out

    def heads_to(self, consumer: PeerInfo) -> Heads | None:
        """Producer side: the head slice this rank sends the consumer rank (as local = this rank's heads), or
        None when that consumer gets its heads from other ranks."""
        for s in sources(self.geometry.total_kv_heads, self.spec.tp_size, consumer.tp_size, consumer.tp_rank):
            if s.producer_rank == self.spec.tp_rank:
                return Heads(s.producer_offset, s.consumer_offset, s.num_heads)
        return None

    def post(
        self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes = b"", remote_memory: str = ""
    ) -> Xfer:
        """NixlAgent.post(), or the AgentError a test's Faults.fail_posts asks for."""
        if self.faults.fail_posts:
            raise AgentError(f"post {op} to {peer}: failed (test fault)")
        return self.agent.post(op, local, remote, peer, notif, remote_memory)

    def post_prepared(self, prepared: Prepared, notif: bytes = b"") -> Xfer:
        """NixlAgent.post_prepared(), or (the request released) the AgentError a test's Faults.fail_posts or
        fail_prepared_posts asks for."""
        if self.faults.fail_posts or self.faults.fail_prepared_posts:
            prepared.release()
            raise AgentError(f"post {prepared.op} to {prepared.peer}: failed (test fault)")
        return self.agent.post_prepared(prepared, notif)


class ModeCore(Core, Protocol):
    """A mode's transfer-thread half (thread/pull.py, thread/push.py): what the loop drives each turn (Core)
    plus the engine's step metadata and the peers' notifications; called only on the transfer thread."""

    def on_step(self, meta: StepMeta, now: float) -> None: ...
    def on_notif(self, sender: str, msg: Message, now: float) -> None: ...
