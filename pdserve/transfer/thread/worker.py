"""NixlWorker: the ConnectorWorker shared by pull and push; a mode plugs in its Core (the transfer-thread half).

Threads of one worker (one per instance / rank):
- the caller's (engine) thread: register_kv_cache, start, submit, poll_results, stats, shutdown;
- the transfer thread (writer.py): owns the NIXL agent; runs the core, timers and posted commands;
- the side-channel thread (handshake.py): serves handshakes and pings, runs outgoing handshakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from pdserve.config import TransferConfig
from pdserve.transfer.base import ConnectorWorker, KVCacheSpec, StepMeta, TransferResults, TransferStats
from pdserve.transfer.checksum import KVChecksum
from pdserve.transfer.faults import NO_FAULTS, Faults
from pdserve.transfer.layout import live_ranges
from pdserve.transfer.staging import make_stager
from pdserve.transfer.thread.agent import AgentError, NixlAgent
from pdserve.transfer.thread.context import ModeCore, TransferContext
from pdserve.transfer.thread.handshake import SideChannel
from pdserve.transfer.thread.loop import TransferLoop
from pdserve.transfer.thread.netdev import enable_cuda_ipc_get, restrict_ucx
from pdserve.transfer.thread.peers import Peers
from pdserve.transfer.thread.results import ResultSink
from pdserve.transfer.wire import (
    WIRE_VERSION,
    HandshakeReply,
    HandshakeRequest,
    Message,
    PeerInfo,
    Ping,
    Pong,
    WireError,
    decode,
)
from pdserve.transfer.wire_compat import compat_hash, compat_values, incompatibility

log = logging.getLogger(__name__)

HANDOFF_WAIT_S = 0.002  # push: longest the engine thread waits in submit() for the transfer thread to take its sends


class _Dispatch:
    """Per loop turn: read notifications (this also drives NIXL progress as a target), hand them to the
    mode's core, then let the core poll its posted transfers."""

    def __init__(self, ctx: TransferContext, core: ModeCore) -> None:
        self.ctx, self.core = ctx, core

    def progress(self, now: float) -> bool:
        faults = self.ctx.faults
        for sender, raw in self.ctx.agent.notifications():
            self.ctx.peers.heard_from(sender, now)  # a sign of life, whatever it says (peers.py, liveness)
            try:
                msg = decode(raw)
            except WireError as e:
                log.warning("dropping a malformed notification from %s: %s", sender, e)
                continue
            if faults is NO_FAULTS:
                self.core.on_notif(sender, msg, now)
            else:
                self._faulty(sender, msg, now)
        return self.core.progress(now)

    def _faulty(self, sender: str, msg: Message, now: float) -> None:
        """A test's Faults: drop, duplicate or delay (so reorder) this notification."""
        faults, name = self.ctx.faults, type(msg).__name__
        if name in faults.drop_notifs:
            log.info("test fault: dropped %s from %s", name, sender)
        elif name in faults.delay_notifs:
            self.ctx.thread.call_at(now + faults.notif_delay_s,
                                    lambda: self.core.on_notif(sender, msg, time.monotonic()))  # fmt: skip
        else:
            for _ in range(2 if name in faults.duplicate_notifs else 1):
                self.core.on_notif(sender, msg, now)

    def in_flight(self) -> bool:
        return self.core.in_flight()


def local_peer_info(cfg: TransferConfig, spec: KVCacheSpec, agent: NixlAgent, epoch: int) -> PeerInfo:
    info = PeerInfo(
        engine_id=cfg.engine_id, agent_name=agent.name, agent_metadata=agent.metadata, model_name=spec.model_name,
        dtype=spec.dtype, transfer_mode=cfg.mode, wire_version=WIRE_VERSION, geometry=spec.geometry,
        base_addr=spec.base_addr, device_id=spec.device_id, memory=spec.memory, tp_rank=spec.tp_rank,
        tp_size=spec.tp_size, rank_ports=list(spec.rank_ports), compat_hash="", epoch=epoch,
        kv_checksum=cfg.kv_checksum,
    )  # fmt: skip
    return dataclasses.replace(info, compat_hash=compat_hash(compat_values(info)))


def refusal_info(info: PeerInfo) -> PeerInfo:
    """What a refused handshake tells the peer: the compatibility fields (and TP shape) it needs to name the
    difference from its side, nothing that locates or reaches this instance (no agent name or NIXL metadata, no
    addresses, ports, cache size or epoch)."""
    return dataclasses.replace(
        info, agent_name="", agent_metadata=b"", base_addr=0, geometry=dataclasses.replace(info.geometry,
        num_blocks=0, block_size=0), device_id=0, memory="", rank_ports=[], epoch=0,
    )  # fmt: skip


class NixlWorker(ConnectorWorker):
    """Subclasses provide make_core(ctx) -> ModeCore."""

    def __init__(self, cfg: TransferConfig, side: SideChannel, faults: Faults = NO_FAULTS) -> None:
        self.cfg = cfg
        self.faults = faults  # a test's (faults.py); NO_FAULTS in production
        self.side = side
        self.sink = ResultSink()
        self.thread = TransferLoop(f"pdserve-transfer-{cfg.engine_id}")
        self.ctx: TransferContext | None = None
        self._core: ModeCore | None = None
        self._started = False
        self.epoch = time.time_ns()  # PeerInfo.epoch: peers tell this process from a restarted one at our address

    def make_core(self, ctx: TransferContext) -> ModeCore:
        raise NotImplementedError

    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        name = f"{self.cfg.engine_id}-r{spec.tp_rank}-{uuid.uuid4().hex[:8]}"
        stager = make_stager(self.cfg.kv_buffer_device, kv_cache, spec, self.faults)
        if stager is not None:  # NIXL, the layout and the handshake see the mirror, never the cache itself
            kv_cache, spec = stager.mirror, stager.spec(spec)
        # the advertised address, not a wildcard bind: UCX listens where peers are told to dial (netdev.py)
        restrict_ucx(self.side.host, self.cfg.net_devices)  # UCX reads it when the agent is created
        if spec.memory == "VRAM":  # (on a host without CUDA, UCX would warn the variable is unused)
            enable_cuda_ipc_get()  # pull's READ by cuda_ipc, not emulated over TCP, on GPUs without NVLink
        agent = NixlAgent(name, kv_cache, spec)
        local = local_peer_info(self.cfg, spec, agent, self.epoch)
        peers = Peers(agent, local, self.side, self.thread, self.cfg.heartbeat_s, self.cfg.peer_timeout_s)
        checksum = KVChecksum(kv_cache) if self.cfg.kv_checksum else None  # over what NIXL moves (the mirror)
        self.ctx = TransferContext(
            self.cfg, spec, agent, local, self.side, self.thread, self.sink, peers, stager, checksum, self.faults
        )

    def start(self, wakeup: Callable[[], None]) -> None:
        # Start order: transfer thread, then side channel (a handshake may post work to the thread at once).
        # Shutdown order (shutdown()): side channel first (no new handshakes), then the transfer thread
        # (after its in-flight transfers drained), then the agent (deregister memory) — nothing may call
        # the agent once it is closed.
        if self.ctx is None:
            raise RuntimeError("register_kv_cache() must come before start()")
        self.sink.wakeup = wakeup
        self._core = self.make_core(self.ctx)
        self.thread.start(_Dispatch(self.ctx, self._core))
        self.side.start(self._serve)
        self._started = True

    def submit(self, meta: StepMeta) -> None:
        if not meta:
            return
        core = self._core
        if core is None:
            raise RuntimeError("start() must come before submit()")
        stager = self.ctx.stager if self.ctx is not None else None
        if stager is not None and meta.sends:
            if self.cfg.mode == "pull":
                # D READs as soon as it has P's response, which the engine returns only after this call:
                # the blocks must be in the mirror (copy done) before submit() returns (staging.py).
                for send in meta.sends:
                    for table, first in live_ranges(send.tables, stager.block_size):
                        stager.stage_out(table, first, max(0, send.num_tokens - first), engine_thread=True)
            else:  # push: the transfer thread copies just before its WRITE, after this point of the stream
                stager.mark_ready()

        # push: rank 0's engine thread hands the GIL to the transfer thread before its own work after the step (the
        # outputs, the stats). A rank above 0 has no such work: it would only delay its next forward pass, and rank 0
        # waits for that pass in the collectives.
        rank = self.ctx.spec.tp_rank if self.ctx is not None else 0
        taken = threading.Event() if meta.sends and self.cfg.mode == "push" and rank == 0 else None

        def on_step() -> None:  # "send_taken": when this thread got a finished prefill (the hand-over's first part)
            if taken is not None:
                taken.set()
            for send in meta.sends:
                self.sink.event(send.request_id, "send_taken")
            core.on_step(meta, time.monotonic())

        self.thread.post(on_step)
        if taken is not None:
            # Woken, the transfer thread still needs the GIL, which the engine thread would keep through its work after
            # the step (outputs to the event loop, the stats snapshot): about that long (0.1-1 ms) on push's hand-over.
            # Blocking here until the transfer thread runs hands the GIL over first; the thread keeps it (up to the
            # switch interval) through the post of a prepared WRITE (~0.1 ms). /tmp script, dev host: post -> run
            # 0.36 -> 0.05 ms median with 300 us of engine work after the post (docs/benchmarks.md).
            taken.wait(HANDOFF_WAIT_S)

    def poll_results(self) -> TransferResults:
        return self.sink.drain()

    def stats(self) -> TransferStats:
        return dataclasses.replace(self.sink.stats(), side_channel_refused=self.side.refusal_counts())

    def shutdown(self) -> None:
        self.side.close()
        self.thread.stop()
        if self.ctx is not None:
            self.ctx.agent.close()
            self.ctx = None

    # ---- side channel (runs on the side-channel thread) ---------------------------------------------------------
    async def _serve(self, msg: Message) -> Message:
        ctx = self.ctx
        if ctx is None:
            return HandshakeReply(False, None, "this instance has no KV cache registered yet")
        if isinstance(msg, Ping):
            return Pong(ctx.local.engine_id, ctx.local.agent_name, ctx.local.epoch)
        if not isinstance(msg, HandshakeRequest):
            return HandshakeReply(False, None, f"unexpected side-channel message {type(msg).__name__}")
        err = incompatibility(ctx.local, msg.peer, local_is_producer=True)
        if err is not None:
            log.warning("refused a handshake: %s", err)
            return HandshakeReply(False, refusal_info(ctx.local), err)  # lets the peer word the error its way
        if msg.load_me:
            try:
                await asyncio.wrap_future(self.thread.call(lambda: ctx.peers.accept(msg.peer)))
            except AgentError as e:
                return HandshakeReply(False, None, f"cannot load agent {msg.peer.agent_name}: {e}")
        return HandshakeReply(True, ctx.local, "")
