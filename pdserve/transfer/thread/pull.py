"""Pull mode on the transfer thread: D READs P's pinned blocks after P has finished (docs/architecture.md).
The scheduler half is scheduler/pull.py.

P (on_request_finished with do_remote_decode) pins the request's blocks under a lease and answers with its
block coordinates; D handshakes with P once per address, READs the token range it lacks, reports the recv
finished, then sends P a PullRelease notification so P frees the blocks (or the lease expires: "expired").
D's READ carries no notification: a READ that carries (or follows) one completes only after P polls, so
D reports the recv first and releases after (measured on this machine: ~30 us vs ~1 ms).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.transfer.base import RecvTask, SendTask, StepMeta
from pdserve.transfer.layout import LayoutError, descriptors, num_bytes, token_segments
from pdserve.transfer.params import PullSource
from pdserve.transfer.thread.agent import AgentError, PeerGone, Xfer, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.landing import land
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.thread.worker import NixlWorker
from pdserve.transfer.wire import Message, PullRelease, encode

log = logging.getLogger(__name__)

ABORT_RETRY_S = 1.0  # a timed-out READ NIXL could not cancel is retried this often (blocks stay held)
MAX_EARLY_RELEASES = 4096  # releases that arrived before their SendTask (kept briefly)


class ReadState(enum.Enum):
    """D: a pull's steps, in order (STAGING only with a host mirror)."""

    HANDSHAKE = "handshake"  # waiting for P's handshake
    READING = "reading"  # READ posted
    STAGING = "staging"  # landed in the mirror; copy-in pending (nothing more lands)


@dataclass
class _Read:
    """D: one request's pull, from handshake to READ done."""

    task: RecvTask
    remote: PullSource
    state: ReadState = ReadState.HANDSHAKE
    peer: Peer | None = None
    xfer: Xfer | None = None
    cancelled: bool = False  # aborted by the engine: report as cancelled when the READ is over
    posted_at: float = 0.0


class PullCore:
    """Both pull halves on the transfer thread (an instance may serve as P and D at once)."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.pinned: dict[str, SendTask] = {}  # P: request id -> blocks pinned until release or lease
        self.early: OrderedDict[str, PullRelease] = OrderedDict()  # P: releases that beat their SendTask
        self.reads: dict[str, _Read] = {}  # D: request id -> pull in progress

    def on_step(self, meta: StepMeta, now: float) -> None:
        for send in meta.sends:
            self._pin(send, now)
        for recv in meta.recvs:
            self._start(recv, now)
        for rid in meta.cancels:
            self._cancel(rid)

    def on_notif(self, sender: str, msg: Message, now: float) -> None:
        if not isinstance(msg, PullRelease):
            log.warning("pull: ignoring %s from %s", type(msg).__name__, sender)
            return
        if self.pinned.pop(msg.request_id, None) is not None:
            self.ctx.sink.send_finished(msg.request_id, SendOutcome.OK if msg.ok else SendOutcome.FAILED, msg.num_bytes)
            return
        self.early[msg.request_id] = msg
        while len(self.early) > MAX_EARLY_RELEASES:
            self.early.popitem(last=False)

    def progress(self, now: float) -> bool:
        for rid, rd in list(self.reads.items()):
            if rd.state is ReadState.READING:
                self._check(rid, rd)
        # P polls fast while it has pinned blocks: D's next READ after a release completes only once P polls
        return bool(self.pinned) or any(rd.state is ReadState.READING for rd in self.reads.values())

    def in_flight(self) -> bool:
        return any(rd.state is ReadState.READING for rd in self.reads.values())

    # ---- P side -----------------------------------------------------------------------------------------------------
    def _pin(self, send: SendTask, now: float) -> None:
        rid = send.request_id
        if (rel := self.early.pop(rid, None)) is not None:
            self.ctx.sink.send_finished(rid, SendOutcome.OK if rel.ok else SendOutcome.FAILED, rel.num_bytes)
            return
        self.pinned[rid] = send
        self.ctx.thread.call_at(now + self.ctx.cfg.lease_s, lambda: self._expire(rid, send))

    def _expire(self, rid: str, send: SendTask) -> None:
        if self.pinned.get(rid) is send:
            del self.pinned[rid]
            log.info("pull: lease of %s expired after %g s; freeing its blocks", rid, self.ctx.cfg.lease_s)
            self.ctx.sink.send_finished(rid, SendOutcome.EXPIRED)

    # ---- D side -----------------------------------------------------------------------------------------------------
    def _start(self, task: RecvTask, now: float) -> None:
        rid, remote = task.request_id, task.source
        if not isinstance(remote, PullSource):  # a deployment mixing modes: fail it (the router's 502)
            self.ctx.sink.recv_failed(rid, "kv_transfer_params are for push mode, this instance is in pull mode")
            return
        end = task.start_token + task.num_tokens
        if end > remote.num_tokens:
            self.ctx.sink.recv_failed(rid, f"prefill has KV for {remote.num_tokens} tokens, {end} needed")
            return
        rd = _Read(task, remote)
        self.reads[rid] = rd
        self.ctx.thread.call_at(now + self.ctx.cfg.recv_timeout_s, lambda: self._timeout(rid, rd))
        self.ctx.peers.connect(
            remote.host, remote.port, remote.engine_id, False, lambda p, e: self._on_peer(rid, rd, p, e)
        )

    def _on_peer(self, rid: str, rd: _Read, peer: Peer | None, error: str | None) -> None:
        rd.peer = peer
        if self.reads.get(rid) is not rd:  # cancelled or timed out meanwhile: just free P's blocks early
            self._release(rd, ok=False, nbytes=0)
            return
        if peer is None:
            self._end(rid, rd, f"handshake with {rd.remote.host}:{rd.remote.port} failed: {error}")
            return
        task, remote = rd.task, rd.remote
        if remote.block_size is not None and remote.block_size != peer.info.block_size:
            self._end(rid, rd, f"params say block size {remote.block_size}, P reports {peer.info.block_size}")
            return
        if task.num_tokens == 0:
            self._end(rid, rd, None)
            return
        try:
            segs = token_segments(self.ctx.layout, task.block_ids, peer.layout, remote.block_ids,
                                  task.start_token, task.num_tokens)  # fmt: skip
            local_descs, remote_descs = descriptors(self.ctx.layout, peer.layout, segs)
            rd.posted_at, posted_wall = time.monotonic(), time.time()  # the post may complete the READ
            rd.xfer = self.ctx.agent.post(
                "READ", local_descs, remote_descs, peer.agent_name, remote_memory=peer.info.memory
            )
        except (LayoutError, AgentError) as e:
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(peer)
            self._end(rid, rd, f"READ from {peer.engine_id} not posted: {e}")
            return
        rd.state = ReadState.READING
        self.ctx.sink.event(rid, "transfer_posted", posted_wall)
        self.ctx.sink.posted(rd.xfer.num_descs, rd.xfer.post_seconds)
        if num_bytes(self.ctx.layout, segs) != rd.xfer.num_bytes:  # a bug in layout.py, never the peer's fault
            log.error("pull: descriptor bytes %d != segment bytes", rd.xfer.num_bytes)
        self._check(rid, rd)

    def _check(self, rid: str, rd: _Read) -> None:
        assert rd.xfer is not None and rd.peer is not None
        try:
            state = self.ctx.agent.check(rd.xfer)
        except PeerGone as e:
            self.ctx.peers.forget(rd.peer)
            self._end(rid, rd, f"prefill instance {rd.peer.engine_id} went away during the READ: {e}")
            return
        if state is XferState.DONE:
            self.ctx.sink.event(rid, "transfer_done")
            self._landed(rid, rd)
        elif state is XferState.ERR:
            self._end(rid, rd, f"READ from {rd.peer.engine_id} failed")

    def _landed(self, rid: str, rd: _Read) -> None:
        """The READ is DONE. Staging: the data is in the mirror; copy it into the KV cache before reporting."""
        if rd.cancelled:
            self._end(rid, rd, None)
            return
        if self.ctx.stager is not None:
            rd.state = ReadState.STAGING
        land(self.ctx, rd.task, lambda: self.reads.get(rid) is rd, lambda error: self._end(rid, rd, error))

    def _end(self, rid: str, rd: _Read, error: str | None) -> None:
        """The recv is over and its blocks are safe: report it once, then free P's blocks."""
        del self.reads[rid]
        nbytes = rd.xfer.num_bytes if rd.xfer is not None and error is None else 0
        if rd.cancelled:
            self.ctx.sink.recv_cancelled(rid)
        elif error is None:
            secs = time.monotonic() - rd.posted_at if rd.xfer is not None else None
            self.ctx.sink.recv_finished(rid, nbytes, secs)
        else:
            log.warning("pull of %s failed: %s", rid, error)
            self.ctx.sink.recv_failed(rid, error)
        self._release(rd, ok=error is None and not rd.cancelled, nbytes=nbytes)

    def _release(self, rd: _Read, ok: bool, nbytes: int) -> None:
        if rd.peer is None or self.ctx.peers.by_agent(rd.peer.agent_name) is None:
            return  # no live peer to tell; its lease frees the blocks
        try:
            self.ctx.agent.send_notif(rd.peer.agent_name, encode(PullRelease(rd.remote.request_id, ok, nbytes)))
        except AgentError as e:
            log.warning("pull: could not release %s on %s: %s", rd.remote.request_id, rd.peer.engine_id, e)
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(rd.peer)

    def _timeout(self, rid: str, rd: _Read) -> None:
        if self.reads.get(rid) is not rd or rd.state is ReadState.STAGING:
            return
        timeout = self.ctx.cfg.recv_timeout_s
        if rd.state is ReadState.HANDSHAKE:
            self._end(rid, rd, f"no handshake with {rd.remote.host}:{rd.remote.port} within {timeout:g} s")
        elif rd.xfer is not None and self.ctx.agent.abort(rd.xfer):
            self._end(rid, rd, f"READ not done within {timeout:g} s (cancelled)")
        else:  # NIXL could not cancel it: the READ may still land, so the blocks stay held
            self.ctx.thread.call_at(time.monotonic() + ABORT_RETRY_S, lambda: self._timeout(rid, rd))

    def _cancel(self, rid: str) -> None:
        rd = self.reads.get(rid)
        if rd is None:
            return  # already reported (finished or failed): the engine frees the blocks on that result
        rd.cancelled = True
        if rd.state in (
            ReadState.HANDSHAKE,
            ReadState.STAGING,
        ):  # staging: the data is in the mirror, nothing more lands
            self._end(rid, rd, None)


class PullWorker(NixlWorker):
    def make_core(self, ctx: TransferContext) -> PullCore:
        return PullCore(ctx)
