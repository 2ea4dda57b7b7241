"""Pull mode on the transfer thread: D READs P's pinned blocks after P has finished (docs/architecture.md).
The scheduler half is scheduler/pull.py; P's pins and leases are pull_pins.py; one pull's state is
pull_read.py's, and how long D waits for P's acks pull_confirm.py's (ConfirmDeadline).

P (on_request_finished with do_remote_decode) pins the request's blocks under a lease and answers with its
block coordinates; D handshakes with P once per address (P loads D's agent, to answer it), READs the token
range it lacks, then sends P a PullRelease naming the request and its blocks. P answers with PullReleaseAck:
held=True when the pin was still in place (then it frees the blocks), held=False when the lease had expired or
the engine released the pin (abort, POST /kv_transfer/release) — its blocks may have been reused while D read.
D reports the recv finished only on held=True; held=False, or no answer in time, fails it (or recomputes, by
policy). The READ itself carries no notification (a READ that carries one completes only after P polls: ~1 ms
vs ~30 us); the confirmation costs one notification round trip (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time

from pdserve.kv.params import PullSource
from pdserve.transfer.base import RecvTask, StepMeta
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.thread.agent import AgentError, PeerGone, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.give_back import give_back
from pdserve.transfer.thread.kv_verify import consumer_sums, mismatch, release_request
from pdserve.transfer.thread.landing import land, landed_from
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.pull_confirm import ConfirmDeadline
from pdserve.transfer.thread.pull_pins import PinKeeper
from pdserve.transfer.thread.pull_read import Read, ReadState, post_reads
from pdserve.transfer.thread.worker import NixlWorker
from pdserve.transfer.wire import Message, encode
from pdserve.transfer.wire_notifs import PullRelease, PullReleaseAck

log = logging.getLogger(__name__)

ABORT_RETRY_S = 1.0  # a timed-out READ NIXL could not cancel is retried this often (blocks stay held)


class PullCore:
    """Both pull halves on the transfer thread (an instance may serve as P and D at once): P's pins are
    pull_pins.PinKeeper's, D's reads are this class's."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.pins = PinKeeper(ctx)  # P
        self.reads: dict[str, Read] = {}  # D: request id -> pull in progress
        self.confirming: dict[tuple[str, str], str] = {}  # D: Read.ack_keys -> request id
        self.deadline = ConfirmDeadline(ctx, self.reads, self._end)  # D: when to stop waiting for acks
        ctx.peers.on_dead.append(self._peer_dead)

    def on_step(self, meta: StepMeta, now: float) -> None:
        for send in meta.sends:
            self.pins.pin(send, now)
        for rid in meta.releases:
            self.pins.unpin(rid, "the prefill instance released the pin (request aborted or its decode leg failed)")
        for recv in meta.recvs:
            self._start(recv, now)
        for rid in meta.cancels:
            self._cancel(rid)
        for source in meta.refusals:  # D refused these before admission: P frees the pins now
            give_back(self.ctx, source)

    def on_notif(self, sender: str, msg: Message, now: float) -> None:
        if isinstance(msg, PullRelease):
            self.pins.on_release(sender, msg)
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
        return bool(self.pins.pinned) or any(
            rd.state in (ReadState.READING, ReadState.CONFIRMING) for rd in self.reads.values()
        )

    def in_flight(self) -> bool:
        return any(rd.state is ReadState.READING for rd in self.reads.values())

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
        # P's lease of the pin: the capability's expiry when signed (P's clock + lease_s at its answer), else
        # this instance's lease_s from now (a deployment sets one --kv-lease-s; P pinned before D heard of it)
        cap = remote.capability
        lease_left = cap.expires_at - time.time() if cap is not None else self.ctx.cfg.lease_s
        rd = Read(task, remote, lease_end=now + lease_left)
        self.reads[rid] = rd
        self.ctx.thread.call_at(now + self.ctx.cfg.recv_timeout_s, lambda: self._timeout(rid, rd))
        self.ctx.peers.connect_ranks(  # load_me: P answers our PullRelease with a notification
            remote.host, remote.port, remote.engine_id, True, lambda p, e: self._on_peers(rid, rd, p, e)
        )

    def _on_peers(self, rid: str, rd: Read, peers: dict[int, Peer] | None, error: str | None) -> None:
        rd.peers = peers or {}
        if self.reads.get(rid) is not rd:  # cancelled or timed out meanwhile: just free P's blocks early
            self._release(rd, ok=False)
            return
        if peers is None:
            self._end(rid, rd, f"handshake with {rd.remote.host}:{rd.remote.port} failed: {error}")
            return
        task, remote, info = rd.task, rd.remote, peers[0].info
        if remote.block_size is not None and remote.block_size != info.geometry.block_size:
            self._end(rid, rd, f"params say block size {remote.block_size}, P reports {info.geometry.block_size}")
            return
        if task.num_tokens == 0:  # nothing read: the release needs no confirmation
            self._end(rid, rd, None)
            return
        rd.state = ReadState.POSTING
        self.ctx.faults.defer(FaultPoint.READ, self.ctx.thread.call_at, lambda: self._post(rid, rd))

    def _post(self, rid: str, rd: Read) -> None:
        """One READ per P rank that holds heads of this rank (heads.py), all posted at once (pull_read.py)."""
        if self.reads.get(rid) is not rd:
            return
        if rd.cancelled:
            self._end(rid, rd, None)
            return
        posted_wall = time.time()
        error = post_reads(self.ctx, rd)
        if error is not None:
            self._abort_reads(rd)
            self._end(rid, rd, error)
            return
        rd.state = ReadState.READING
        self.ctx.sink.event(rid, "transfer_posted", posted_wall)
        self._check(rid, rd)

    def _abort_reads(self, rd: Read) -> None:
        for xfer in rd.xfers.values():  # best effort; _end frees the blocks only when nothing is in flight
            self.ctx.agent.abort(xfer)

    def _check(self, rid: str, rd: Read) -> None:
        faults = self.ctx.faults
        held_back = rid in faults.slow_reads and time.monotonic() < rd.posted_at + faults.slow_read_s
        for p_rank, xfer in rd.xfers.items():
            peer = rd.peers[p_rank]
            try:
                state = self.ctx.agent.check(xfer)
            except PeerGone as e:
                self.ctx.peers.forget(peer)
                self._abort_reads(rd)
                self._end(rid, rd, f"prefill instance {peer.engine_id} rank {p_rank} went away during the READ: {e}")
                return
            if state is XferState.ERR:
                self._abort_reads(rd)
                self._end(rid, rd, f"READ from {peer.engine_id} rank {p_rank} failed")
                return
        if not held_back and all(x.state is XferState.DONE for x in rd.xfers.values()):
            self.ctx.sink.event(rid, "transfer_done")
            self._landed(rid, rd)

    def _landed(self, rid: str, rd: Read) -> None:
        """Every READ is DONE: release every P rank's pin and wait for each to confirm it held throughout."""
        rd.state = ReadState.CONFIRMING  # (before reads_over: this read no longer holds P's answers back)
        self.deadline.reads_over(rd)
        if rd.cancelled:
            self._end(rid, rd, None)
            return
        for p_rank, peer in rd.peers.items():
            rel = rd.release(p_rank, ok=True, check=release_request(self.ctx, rd.task, rd.peers[0].info, p_rank))
            try:
                self.ctx.agent.send_notif(peer.agent_name, encode(rel))
            except AgentError as e:
                if isinstance(e, PeerGone):
                    self.ctx.peers.forget(peer)
                self._end(
                    rid, rd, f"release not sent to {peer.engine_id} rank {p_rank}, so the READ is unconfirmed: {e}"
                )
                return
            rd.unacked.add(p_rank)
            self.confirming[(peer.agent_name, rd.remote.request_id)] = rid
        rd.released_at = time.monotonic()
        self.deadline.start(rid, rd)
        rd.sums = consumer_sums(self.ctx, rd.task, rd.peers[0].info)  # --kv-checksum, while P sums its side

    def _on_ack(self, sender: str, msg: PullReleaseAck) -> None:
        rid = self.confirming.pop((sender, msg.request_id), None)
        rd = None if rid is None else self.reads.get(rid)
        if rid is None or rd is None:
            log.debug("pull: ack for %s from %s matches no read", msg.request_id, sender)
            return
        p_rank = next((r for r, p in rd.peers.items() if p.agent_name == sender), -1)
        rd.unacked.discard(p_rank)
        rd.sent_sums[p_rank] = msg.checksum
        self.ctx.sink.event(rid, f"pull_ack.r{self.ctx.spec.tp_rank}.p{p_rank}")
        if not msg.held and msg.refused:  # P never held KV under these coordinates: the request's error
            self._end(rid, rd, f"the prefill instance holds no KV under these coordinates: {msg.reason}", True)
        elif not msg.held:
            self._end(rid, rd, f"the prefill instance's pin did not hold until the READ was over ({msg.reason})")
        elif rd.unacked:
            return  # other P ranks still to confirm
        elif rd.cancelled:
            self._end(rid, rd, None)
        elif (bad := mismatch(self.ctx, rd.sums, rd.sent_sums, rd.remote.engine_id)) is not None:
            self._end(rid, rd, bad)
        else:  # staging: the data is in the mirror; copy it into the KV cache before reporting
            if self.ctx.stager is not None:
                rd.state = ReadState.STAGING
            land(self.ctx, rd.task, rd.peers[0].info.geometry.block_size, lambda: self.reads.get(rid) is rd,
                 lambda error: self._end(rid, rd, error))  # fmt: skip

    def _peer_dead(self, peer: Peer) -> None:
        """Liveness: a P rank is gone (or restarted); nothing more lands from it, nothing will confirm."""
        for rid, rd in list(self.reads.items()):
            names = {p.agent_name for p in rd.peers.values()}
            if peer.agent_name not in names or rd.state is ReadState.STAGING:
                continue
            dead = {r for r, p in rd.peers.items() if p.agent_name == peer.agent_name}
            self._end_aborted(rid, rd, dead, f"prefill instance {peer.engine_id} (rank {peer.info.tp_rank}) is gone")
        self.deadline.forget(peer.agent_name)

    def _end_aborted(self, rid: str, rd: Read, dead: set[int], error: str) -> None:
        """End the read once none of its READs may still land: those from the dead P ranks cannot (their process
        is gone; aborted best effort); one from a live P rank that NIXL cannot cancel keeps the blocks held."""
        if self.reads.get(rid) is not rd:
            return
        if rd.state is ReadState.READING:
            if not all(self.ctx.agent.abort(x) or r in dead for r, x in rd.xfers.items()):
                self.ctx.thread.call_at(time.monotonic() + ABORT_RETRY_S,
                                        lambda: self._end_aborted(rid, rd, dead, error))  # fmt: skip
                return
        self._end(rid, rd, error)

    def _end(self, rid: str, rd: Read, error: str | None, refused: bool = False) -> None:
        """The recv is over and its blocks are safe: report it once, then free P's blocks on every rank (refused:
        the error is P's answer that it holds no KV under the request's coordinates)."""
        del self.reads[rid]
        if rd.state is ReadState.READING:  # its READs are over (DONE, failed or cancelled)
            self.deadline.reads_over(rd)
        for key in rd.ack_keys():
            self.confirming.pop(key, None)
        nbytes = rd.num_bytes if error is None else 0
        if rd.cancelled:
            self.ctx.sink.recv_cancelled(rid)
        elif error is None:
            secs = time.monotonic() - rd.posted_at if rd.xfers else None
            peer_bs = rd.peers[0].info.geometry.block_size  # finished: the handshake was done
            end = rd.task.start_token + rd.task.num_tokens  # the first token only with KV up to where P's ends
            first = rd.remote.first_token_id if end == rd.remote.num_tokens else None
            self.ctx.sink.recv_finished(rid, nbytes, secs, landed_from(self.ctx, rd.task, peer_bs), first)
        else:
            log.warning("pull of %s failed: %s", rid, error)
            self.ctx.sink.recv_failed(rid, error, refused)
        self._release(rd, ok=error is None and not rd.cancelled)

    def _release(self, rd: Read, ok: bool) -> None:
        """Tell every P rank not told yet that this rank is done with the pin (its lease frees it otherwise)."""
        for p_rank, peer in rd.peers.items():
            if p_rank in rd.released or self.ctx.peers.by_agent(peer.agent_name) is None:
                continue
            rel = rd.release(p_rank, ok)
            try:
                self.ctx.agent.send_notif(peer.agent_name, encode(rel))
            except AgentError as e:
                log.warning("pull: could not release %s on %s: %s", rd.remote.request_id, peer.engine_id, e)
                if isinstance(e, PeerGone):
                    self.ctx.peers.forget(peer)

    def _timeout(self, rid: str, rd: Read) -> None:
        if self.reads.get(rid) is not rd or rd.state in (ReadState.STAGING, ReadState.CONFIRMING):
            return  # the READ is over (CONFIRMING has its own deadline)
        timeout = self.ctx.cfg.recv_timeout_s
        if rd.state in (ReadState.HANDSHAKE, ReadState.POSTING):
            self._end(rid, rd, f"no handshake with {rd.remote.host}:{rd.remote.port} within {timeout:g} s")
        elif all(self.ctx.agent.abort(x) for x in rd.xfers.values()):
            self._end(rid, rd, f"READ not done within {timeout:g} s (cancelled)")
        else:  # NIXL could not cancel one: it may still land, so the blocks stay held
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
