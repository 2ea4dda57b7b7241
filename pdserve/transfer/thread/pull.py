"""Pull mode on the transfer thread: D READs P's pinned blocks after P has finished (docs/architecture.md).
The scheduler half is scheduler/pull.py.

P (on_request_finished with do_remote_decode) pins the request's blocks under a lease and answers with its
block coordinates; D handshakes with P once per address (P loads D's agent, to answer it), READs the token
range it lacks, then sends P a PullRelease naming the request and its blocks. P answers with PullReleaseAck:
held=True when the pin was still in place (then it frees the blocks), held=False when the lease had expired or
the engine released the pin (abort, POST /kv_transfer/release) — its blocks may have been reused while D read.
D reports the recv finished only on held=True; held=False, or no answer within peer_timeout_s, fails it (or
recomputes, by policy). The READ itself carries no notification (a READ that carries one completes only after
P polls: ~1 ms vs ~30 us); the confirmation costs one notification round trip (docs/benchmarks.md).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.transfer.base import RecvTask, SendTask, StepMeta
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.layout import LayoutError, descriptors, num_bytes, token_segments
from pdserve.transfer.params import PullSource
from pdserve.transfer.thread.agent import AgentError, PeerGone, Xfer, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.landing import land
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.thread.worker import NixlWorker
from pdserve.transfer.wire import Message, PullRelease, PullReleaseAck, encode

log = logging.getLogger(__name__)

ABORT_RETRY_S = 1.0  # a timed-out READ NIXL could not cancel is retried this often (blocks stay held)
MAX_EARLY_RELEASES = 4096  # releases that arrived before their SendTask (kept briefly)
MAX_GONE_PINS = 16384  # P: request ids whose pins ended without a release (expired, released), for late releases


class ReadState(enum.Enum):
    """D: a pull's steps, in order (STAGING only with a host mirror)."""

    HANDSHAKE = "handshake"  # waiting for P's handshake
    POSTING = "posting"  # handshake done, READ not posted yet (only while a test delays it)
    READING = "reading"  # READ posted
    CONFIRMING = "confirming"  # READ done, PullRelease sent: waiting for P's PullReleaseAck (nothing more lands)
    STAGING = "staging"  # confirmed, landed in the mirror; copy-in pending (nothing more lands)


@dataclass
class _Read:
    """D: one request's pull, from handshake to READ done."""

    task: RecvTask
    remote: PullSource
    state: ReadState = ReadState.HANDSHAKE
    peer: Peer | None = None
    xfer: Xfer | None = None
    cancelled: bool = False  # aborted by the engine: report as cancelled when the READ is over
    released: bool = False  # the PullRelease was sent (P is told exactly once)
    posted_at: float = 0.0

    @property
    def ack_key(self) -> tuple[str, str]:
        """(P's agent, P's request id): how P's PullReleaseAck finds this read."""
        assert self.peer is not None
        return self.peer.agent_name, self.remote.request_id


class PullCore:
    """Both pull halves on the transfer thread (an instance may serve as P and D at once)."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.pinned: dict[str, SendTask] = {}  # P: request id -> blocks pinned until release or lease
        self.early: OrderedDict[str, tuple[str, PullRelease]] = OrderedDict()  # P: (sender, release) before the pin
        self.gone: OrderedDict[str, str] = OrderedDict()  # P: request id -> why its pin ended without a release
        self.reads: dict[str, _Read] = {}  # D: request id -> pull in progress
        self.confirming: dict[tuple[str, str], str] = {}  # D: _Read.ack_key -> request id
        ctx.peers.on_dead.append(self._peer_dead)

    def on_step(self, meta: StepMeta, now: float) -> None:
        for send in meta.sends:
            self._pin(send, now)
        for rid in meta.releases:
            self._unpin(rid, "the prefill instance released the pin (request aborted or its decode leg failed)")
        for recv in meta.recvs:
            self._start(recv, now)
        for rid in meta.cancels:
            self._cancel(rid)

    def on_notif(self, sender: str, msg: Message, now: float) -> None:
        if isinstance(msg, PullRelease):
            self._on_release(sender, msg)
        elif isinstance(msg, PullReleaseAck):
            self._on_ack(sender, msg)
        else:
            log.warning("pull: ignoring %s from %s", type(msg).__name__, sender)

    def progress(self, now: float) -> bool:
        for rid, rd in list(self.reads.items()):
            if rd.state is ReadState.READING:
                self._check(rid, rd)
        # P polls fast while it has pinned blocks: D's next READ after a release completes only once P polls;
        # D polls fast while it waits for P's ack
        return bool(self.pinned) or any(
            rd.state in (ReadState.READING, ReadState.CONFIRMING) for rd in self.reads.values()
        )

    def in_flight(self) -> bool:
        return any(rd.state is ReadState.READING for rd in self.reads.values())

    # ---- P side -----------------------------------------------------------------------------------------------------
    def _pin(self, send: SendTask, now: float) -> None:
        rid = send.request_id
        if rid in self.pinned:  # never: P's request ids are its own; a second pin would leak the first's blocks
            log.error("pull: request %s is pinned already; the new send is freed at once", rid)
            self.ctx.sink.send_finished(rid, SendOutcome.FAILED)
            return
        self.gone.pop(rid, None)
        self.pinned[rid] = send
        self.ctx.thread.call_at(now + self.ctx.cfg.lease_s, lambda: self._expire(rid, send))
        if (early := self.early.pop(rid, None)) is not None:  # the engine held the blocks meanwhile: still pinned
            self._on_release(*early)

    def _on_release(self, sender: str, msg: PullRelease) -> None:
        """D is done with (or gave up on) a pin. Only a pin of exactly the release's blocks is freed."""
        rid = msg.request_id
        send = self.pinned.get(rid)
        if send is None:
            if (why := self.gone.get(rid)) is not None:
                self._ack(sender, msg, False, why)
            else:  # before its SendTask (the engine holds the blocks until then), or unknown: answered at the pin
                self.early[rid] = (sender, msg)
                while len(self.early) > MAX_EARLY_RELEASES:
                    self.early.popitem(last=False)
            return
        if list(send.block_ids) != msg.block_ids:
            log.warning("pull: release of %s names blocks %s, the pin holds %s; pin kept", rid, msg.block_ids,
                        list(send.block_ids))  # fmt: skip
            self._ack(sender, msg, False, "the release names other blocks than the pin holds")
            return
        del self.pinned[rid]
        self.ctx.sink.send_finished(rid, SendOutcome.OK if msg.ok else SendOutcome.FAILED, msg.num_bytes)
        self._ack(sender, msg, True, "")

    def _ack(self, sender: str, msg: PullRelease, held: bool, reason: str) -> None:
        if not msg.ok:
            return  # D gave up: it waits for no answer
        if self.ctx.peers.by_agent(sender) is None:
            log.warning("pull: release of %s from unknown agent %s; not answered", msg.request_id, sender)
            return
        try:
            self.ctx.agent.send_notif(sender, encode(PullReleaseAck(msg.request_id, held, reason)))
        except AgentError as e:  # D fails the recv after peer_timeout_s
            log.warning("pull: could not answer the release of %s: %s", msg.request_id, e)

    def _expire(self, rid: str, send: SendTask) -> None:
        if self.pinned.get(rid) is send:
            log.info("pull: lease of %s expired after %g s; freeing its blocks", rid, self.ctx.cfg.lease_s)
            self._unpin(rid, f"the lease of {self.ctx.cfg.lease_s:g} s expired", SendOutcome.EXPIRED)

    def _unpin(self, rid: str, why: str, outcome: SendOutcome = SendOutcome.FAILED) -> None:
        """End a pin without D's release: a release that comes later is answered held=False."""
        self.early.pop(rid, None)
        if self.pinned.pop(rid, None) is None:
            return
        self.gone[rid] = why
        while len(self.gone) > MAX_GONE_PINS:
            self.gone.popitem(last=False)
        self.ctx.sink.send_finished(rid, outcome)

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
        self.ctx.peers.connect(  # load_me: P answers our PullRelease with a notification
            remote.host, remote.port, remote.engine_id, True, lambda p, e: self._on_peer(rid, rd, p, e)
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
        if task.num_tokens == 0:  # nothing read: the release needs no confirmation
            self._end(rid, rd, None)
            return
        rd.state = ReadState.POSTING
        self.ctx.cfg.faults.defer(FaultPoint.READ, self.ctx.thread.call_at, lambda: self._post(rid, rd))

    def _post(self, rid: str, rd: _Read) -> None:
        if self.reads.get(rid) is not rd:
            return
        task, remote, peer = rd.task, rd.remote, rd.peer
        assert peer is not None
        if rd.cancelled:
            self._end(rid, rd, None)
            return
        try:
            segs = token_segments(self.ctx.layout, task.block_ids, peer.layout, remote.block_ids,
                                  task.start_token, task.num_tokens)  # fmt: skip
            local_descs, remote_descs = descriptors(self.ctx.layout, peer.layout, segs)
            rd.posted_at, posted_wall = time.monotonic(), time.time()  # the post may complete the READ
            rd.xfer = self.ctx.post("READ", local_descs, remote_descs, peer.agent_name, remote_memory=peer.info.memory)
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
        """The READ is DONE: release P's pin and wait for P to confirm it held throughout."""
        if rd.cancelled:
            self._end(rid, rd, None)
            return
        assert rd.peer is not None and rd.xfer is not None
        rd.released = True
        rel = PullRelease(rd.remote.request_id, True, rd.xfer.num_bytes, list(rd.remote.block_ids))
        try:
            self.ctx.agent.send_notif(rd.peer.agent_name, encode(rel))
        except AgentError as e:
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(rd.peer)
            self._end(rid, rd, f"release not sent to {rd.peer.engine_id}, so the READ is unconfirmed: {e}")
            return
        rd.state = ReadState.CONFIRMING
        self.confirming[rd.ack_key] = rid
        deadline = self.ctx.cfg.peer_timeout_s
        self.ctx.thread.call_at(time.monotonic() + deadline, lambda: self._confirm_timeout(rid, rd))

    def _on_ack(self, sender: str, msg: PullReleaseAck) -> None:
        rid = self.confirming.pop((sender, msg.request_id), None)
        rd = None if rid is None else self.reads.get(rid)
        if rid is None or rd is None:
            log.debug("pull: ack for %s from %s matches no read", msg.request_id, sender)
            return
        if not msg.held:
            self._end(rid, rd, f"the prefill instance's pin did not hold until the READ was over ({msg.reason})")
        elif rd.cancelled:
            self._end(rid, rd, None)
        else:  # staging: the data is in the mirror; copy it into the KV cache before reporting
            if self.ctx.stager is not None:
                rd.state = ReadState.STAGING
            land(self.ctx, rd.task, lambda: self.reads.get(rid) is rd, lambda error: self._end(rid, rd, error))

    def _confirm_timeout(self, rid: str, rd: _Read) -> None:
        if self.reads.get(rid) is rd and rd.state is ReadState.CONFIRMING:
            t = self.ctx.cfg.peer_timeout_s
            self._end(rid, rd, f"the prefill instance did not confirm its pin within {t:g} s; the READ is unused")

    def _peer_dead(self, peer: Peer) -> None:
        """Liveness: P is gone (or restarted); nothing more lands from it, nothing will confirm."""
        for rid, rd in list(self.reads.items()):
            if rd.peer is None or rd.peer.agent_name != peer.agent_name or rd.state is ReadState.STAGING:
                continue
            if rd.xfer is not None and rd.state is ReadState.READING:
                self.ctx.agent.abort(rd.xfer)  # best effort: the process that could write is gone
            self._end(rid, rd, f"prefill instance {peer.engine_id} is gone")

    def _end(self, rid: str, rd: _Read, error: str | None) -> None:
        """The recv is over and its blocks are safe: report it once, then free P's blocks."""
        del self.reads[rid]
        if rd.peer is not None:
            self.confirming.pop(rd.ack_key, None)
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
        if rd.released or rd.peer is None or self.ctx.peers.by_agent(rd.peer.agent_name) is None:
            return  # told already, or no live peer to tell (its lease frees the blocks)
        rd.released = True
        rel = PullRelease(rd.remote.request_id, ok, nbytes, list(rd.remote.block_ids))
        try:
            self.ctx.agent.send_notif(rd.peer.agent_name, encode(rel))
        except AgentError as e:
            log.warning("pull: could not release %s on %s: %s", rd.remote.request_id, rd.peer.engine_id, e)
            if isinstance(e, PeerGone):
                self.ctx.peers.forget(rd.peer)

    def _timeout(self, rid: str, rd: _Read) -> None:
        if self.reads.get(rid) is not rd or rd.state in (ReadState.STAGING, ReadState.CONFIRMING):
            return  # the READ is over (CONFIRMING has its own deadline)
        timeout = self.ctx.cfg.recv_timeout_s
        if rd.state in (ReadState.HANDSHAKE, ReadState.POSTING):
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
        if rd.state is not ReadState.READING:  # no READ in flight: nothing more lands
            self._end(rid, rd, None)


class PullWorker(NixlWorker):
    def make_core(self, ctx: TransferContext) -> PullCore:
        return PullCore(ctx)
