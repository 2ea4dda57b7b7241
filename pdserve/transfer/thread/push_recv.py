"""Push, decode side (transfer thread): register D's blocks with P, count completions, cancel safely.

A RecvTask arrives when D has allocated the request's blocks. D handshakes with P (once per address; P
loads D's agent so it can WRITE and answer), then sends a PushRegister notification from this thread (the
engine loop never waits on it). Each producer rank's WRITE carries a PushDone that NIXL delivers after the
data; when every producer's has arrived the recv is finished.

The receive clock (recv_timeout_s) runs from the last sign of life of the prefill: the RecvTask's arrival,
then each PushQueued, which P sends at once and every keepalive_ms (a quarter of recv_timeout_s, asked for in
the registration) while it has the registration and the prefill is queued or running. So a slow but working
P never makes D give up; a P that lost the prefill leg (it never answers PushQueued), died, or went silent
does, recv_timeout_s after it last spoke.

Blocks a WRITE may still land in are never reported reusable. Once registered, a timeout or an engine abort
sends PushCancel and the recv ends only when, for every producer, P answered
(PushCancelAck, PushDone or PushFail) or P is known dead (NIXL says disconnected, or P's side channel
refuses or answers with another agent). A timed-out recv whose data landed after all is reported finished.

The producers (PushDone to count) are the P ranks holding this rank's heads, from both sides' TP sizes and
KV heads in P's handshake (heads.py), never the request's params; each rank of a TP instance waits on its own.
Every wait ends: a silent P is declared dead by the heartbeats (peers.py) within peer_timeout_s, and a cancel
P never answers is given up after recv_timeout_s (logged as an error: P is alive yet ignores us).

One recv's state (Wait, its WaitState and how it ends) is push_wait.py's; this module is the protocol that
moves it.
"""

from __future__ import annotations

import logging
import time

from pdserve.kv.params import PushSource
from pdserve.transfer.base import RecvTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.thread.agent import AgentError, PeerGone
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.kv_verify import consumer_sums, mismatch
from pdserve.transfer.thread.landing import land, landed_from
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.push_wait import CancelWhy, RecvEnd, Wait, WaitState
from pdserve.transfer.wire import encode
from pdserve.transfer.wire_notifs import PushCancel, PushCancelAck, PushDone, PushFail, PushQueued, PushRegister

log = logging.getLogger(__name__)

PROBE_AFTER_S = 1.0  # after a cancel gets no answer this long, ask P's side channel whether P still exists
KEEPALIVES_PER_TIMEOUT = 4  # P is asked for a PushQueued this many times per recv_timeout_s
MIN_KEEPALIVE_MS = 10


class RecvSide:
    """D's push recvs on the transfer thread: one Wait per request id, each reported exactly once (_end)."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.waits: dict[str, Wait] = {}  # request id -> wait
        self.by_key: dict[tuple[str, int], str] = {}  # (transfer id, attempt) -> request id
        ctx.peers.on_dead.append(self._on_peer_dead)

    def on_recv(self, task: RecvTask, now: float) -> None:
        rid, remote = task.request_id, task.source
        if not isinstance(remote, PushSource):
            self.ctx.sink.recv_failed(rid, "kv_transfer_params are for pull mode, this instance is in push mode")
            return
        w = Wait(task, remote, alive_at=now)
        if w.key in self.by_key:
            self.ctx.sink.recv_failed(rid, f"transfer {remote.transfer_id} attempt {task.attempt} is already waiting")
            return
        self.waits[rid], self.by_key[w.key] = w, rid
        self.ctx.thread.call_at(now + self.ctx.cfg.recv_timeout_s, lambda: self._timeout(rid, w))
        self.ctx.peers.connect_ranks(
            remote.host, remote.port, remote.engine_id, True, lambda p, e: self._on_peers(rid, w, p, e)
        )

    def _on_peers(self, rid: str, w: Wait, peers: dict[int, Peer] | None, error: str | None) -> None:
        if self.waits.get(rid) is not w:  # cancelled or timed out before registering: nothing can be written
            self._gave_up_unregistered(w, peers or {})
            return
        if peers is None:
            self._end(rid, w, RecvEnd.FAILED, f"handshake with {w.remote.host}:{w.remote.port} failed: {error}")
            return
        w.peers, w.producers = peers, set(self.ctx.heads_from(peers[0].info))
        w.state = WaitState.DELAYED  # until _register(): at once, unless a test delays it
        self.ctx.faults.defer(FaultPoint.REGISTER, self.ctx.thread.call_at, lambda: self._register(rid, w))

    def _register(self, rid: str, w: Wait) -> None:
        """Register with every P rank, writer or not: each P rank's part of the send ends with this rank's."""
        if self.waits.get(rid) is not w:
            return
        t = w.task
        keepalive_ms = max(MIN_KEEPALIVE_MS, int(self.ctx.cfg.recv_timeout_s * 1000 / KEEPALIVES_PER_TIMEOUT))
        msg = PushRegister(w.remote.transfer_id, t.attempt, self.ctx.local.engine_id, list(t.block_ids),
                           self.ctx.geometry.block_size, t.start_token, t.num_tokens, self.ctx.spec.tp_rank,
                           keepalive_ms, block_tables=[list(b) for b in t.block_tables])  # fmt: skip
        w.state, w.registered_at = WaitState.REGISTERED, time.monotonic()
        for p_rank, peer in w.peers.items():
            try:
                self.ctx.agent.send_notif(peer.agent_name, encode(msg))
            except AgentError as e:  # P may or may not have it: cancel properly
                why = f"registration not sent to {peer.engine_id} rank {p_rank}: {e}"
                self._start_cancel(rid, w, CancelWhy.TIMEOUT, why)
                return
        self.ctx.sink.event(rid, "registration_sent")

    # ---- P's notifications ------------------------------------------------------------------------------------------
    def _lookup(self, tid: str, attempt: int) -> tuple[str, Wait] | None:
        rid = self.by_key.get((tid, attempt))
        return None if rid is None else (rid, self.waits[rid])

    def on_done(self, msg: PushDone) -> None:
        if (found := self._lookup(msg.transfer_id, msg.attempt)) is None:
            log.debug("push: completion for unknown %s attempt %d", msg.transfer_id, msg.attempt)
            return
        rid, w = found
        if not w.is_producer(msg.producer_rank):
            log.warning("push: completion from rank %d, which holds none of this rank's heads; ignored",
                        msg.producer_rank)  # fmt: skip
            return
        self.ctx.sink.event(rid, f"push_done.r{self.ctx.spec.tp_rank}.p{msg.producer_rank}")
        w.done_ranks.add(msg.producer_rank)
        w.num_bytes += msg.num_bytes
        w.sums[msg.producer_rank] = msg.checksum
        w.first_token = msg.first_token_id if msg.first_token_id >= 0 else w.first_token
        self._maybe_over(rid, w)

    def on_queued(self, msg: PushQueued, now: float) -> None:
        if (found := self._lookup(msg.transfer_id, msg.attempt)) is not None:
            rid, w = found
            w.alive_at = now  # the receive clock restarts (_timeout re-arms itself)
            if w.num_queued == 0:
                self.ctx.sink.event(rid, "prefill_queued")
            w.num_queued += 1

    def on_fail(self, msg: PushFail) -> None:
        if (found := self._lookup(msg.transfer_id, msg.attempt)) is not None:
            rid, w = found
            w.fail_reason = w.fail_reason or f"prefill instance refused: {msg.reason}"
            w.over_ranks.update(w.producers)  # P's ranks fail together
            self._maybe_over(rid, w)

    def on_ack(self, msg: PushCancelAck) -> None:
        if (found := self._lookup(msg.transfer_id, msg.attempt)) is not None:
            rid, w = found
            if w.is_producer(msg.producer_rank):
                (w.done_ranks if msg.landed else w.over_ranks).add(msg.producer_rank)
            self._maybe_over(rid, w)

    def _maybe_over(self, rid: str, w: Wait) -> None:
        n = w.num_producers
        if w.state is WaitState.STAGING:
            return  # over already: the copy-in ends it
        if len(w.done_ranks) >= n and not w.over_ranks:
            if w.cancel_why is CancelWhy.ABORT:
                self._end(rid, w, RecvEnd.CANCELLED, "")
            else:
                self._landed(rid, w)
        elif len(w.done_ranks | w.over_ranks) >= n:
            self._end(rid, w, w.unlanded_end, w.fail_reason)

    def _landed(self, rid: str, w: Wait) -> None:
        """Every producer's data landed. --kv-checksum: it must match P's sums (kv_verify.py). Staging: it is in the
        mirror; copy it into the KV cache first."""
        ours = consumer_sums(self.ctx, w.task, w.peers[0].info)
        if (bad := mismatch(self.ctx, ours, w.sums, w.remote.engine_id)) is not None:
            self._end(rid, w, RecvEnd.FAILED, bad)
            return
        if self.ctx.stager is not None:
            w.state = WaitState.STAGING  # a cancel now ends the recv at once: nothing more lands, the copy is skipped

        def end(error: str | None) -> None:
            self._end(rid, w, RecvEnd.FINISHED if error is None else RecvEnd.FAILED, error or "")

        land(self.ctx, w.task, w.peers[0].info.geometry.block_size, lambda: self.waits.get(rid) is w, end)

    # ---- timeouts and cancels ----------------------------------------------------------------------------------------
    def _timeout(self, rid: str, w: Wait) -> None:
        if self.waits.get(rid) is not w or w.state in (WaitState.CANCELLING, WaitState.STAGING):
            return
        due = w.alive_at + self.ctx.cfg.recv_timeout_s
        if time.monotonic() < due:  # P said since that it is working on the prefill
            self.ctx.thread.call_at(due, lambda: self._timeout(rid, w))
            return
        reason = f"KV did not arrive within {self.ctx.cfg.recv_timeout_s:g} s"
        if w.num_queued:
            reason += f" of the prefill instance's last 'queued' notice ({w.num_queued} received)"
        if w.state is WaitState.REGISTERED:
            self._start_cancel(rid, w, CancelWhy.TIMEOUT, reason)
        else:
            self._end(rid, w, RecvEnd.FAILED, reason + " (never registered)")
            self._gave_up_unregistered(w, w.peers)

    def on_cancel(self, rid: str) -> None:
        w = self.waits.get(rid)
        if w is None:
            return  # already reported: the engine frees the blocks on that result
        if w.state is WaitState.REGISTERED:
            self._start_cancel(rid, w, CancelWhy.ABORT, "aborted")
        elif w.state is WaitState.CANCELLING:
            w.cancel_why = CancelWhy.ABORT
        else:  # nothing registered yet: nothing can be written
            self._end(rid, w, RecvEnd.CANCELLED, "")
            self._gave_up_unregistered(w, w.peers)

    def _gave_up_unregistered(self, w: Wait, peers: dict[int, Peer]) -> None:
        """This rank gives the transfer up before registering (aborted, timed out): tell every rank of P, so it
        frees the prefill now rather than at its lease (P's PushCancelAck then finds no wait and is dropped)."""
        for peer in peers.values():
            try:
                self.ctx.agent.send_notif(peer.agent_name, encode(PushCancel(w.remote.transfer_id, w.task.attempt)))
            except AgentError as e:
                log.info("push: %s not told that %s was given up: %s", peer.engine_id, w.remote.transfer_id, e)

    def _start_cancel(self, rid: str, w: Wait, why: CancelWhy, reason: str) -> None:
        w.state, w.cancel_why, w.fail_reason = WaitState.CANCELLING, why, reason
        w.cancel_at = time.monotonic()
        self._send_cancel(rid, w)

    def _send_cancel(self, rid: str, w: Wait) -> None:
        for peer in list(w.peers.values()):  # every rank: a non-writer drops the registration it holds
            try:
                self.ctx.agent.send_notif(peer.agent_name, encode(PushCancel(w.remote.transfer_id, w.task.attempt)))
            except PeerGone:
                self._peer_dead(rid, w, peer)
                if self.waits.get(rid) is not w:
                    return
            except AgentError as e:
                log.warning("push: cancel of %s not sent: %s", w.remote.transfer_id, e)
        self.ctx.thread.call_at(time.monotonic() + PROBE_AFTER_S, lambda: self._probe(rid, w))

    def _probe(self, rid: str, w: Wait) -> None:
        if self.waits.get(rid) is not w or w.peer is None:
            return
        self.ctx.peers.probe(w.remote.host, w.remote.port, w.peer, lambda alive: self._on_probe(rid, w, alive))

    def _on_probe(self, rid: str, w: Wait, alive: bool | None) -> None:
        if self.waits.get(rid) is not w:
            return
        if alive is False:
            assert w.peer is not None
            self._peer_dead(rid, w, w.peer)
            return
        if time.monotonic() - w.cancel_at > self.ctx.cfg.recv_timeout_s:
            log.error("push: %s never answered the cancel of %s in %g s; giving its blocks up", w.remote.host,
                      w.remote.transfer_id, self.ctx.cfg.recv_timeout_s)  # fmt: skip
            w.fail_reason += "; the prefill instance never answered the cancel"
            self._end(rid, w, w.unlanded_end, w.fail_reason)
            return
        # alive or unknown, yet silent: P may have forgotten our agent (and cannot answer). Handshake again
        # (P loads us again), then ask again; the blocks stay held meanwhile.
        log.warning("push: no answer from %s to the cancel of %s; asking again", w.remote.host, w.remote.transfer_id)
        self.ctx.peers.connect(w.remote.host, w.remote.port, None, True, lambda p, e: self._resend(rid, w, p), True)

    def _resend(self, rid: str, w: Wait, peer: Peer | None) -> None:
        if self.waits.get(rid) is not w:
            return
        if peer is not None and w.peer is not None and peer.agent_name != w.peer.agent_name:
            self._peer_dead(rid, w, w.peer)  # another process answers there now: ours is gone
            return
        self._send_cancel(rid, w)

    def _on_peer_dead(self, peer: Peer) -> None:
        """Liveness: P is gone (or restarted): nothing more lands from it, nothing will answer."""
        for rid, w in list(self.waits.items()):
            names = {p.agent_name for p in w.peers.values()}
            if peer.agent_name in names and w.state is not WaitState.STAGING:
                w.fail_reason = w.fail_reason or "waiting for the prefill instance"
                self._peer_dead(rid, w, peer)

    def _peer_dead(self, rid: str, w: Wait, peer: Peer) -> None:
        """One rank of P is gone: nothing more lands from it. Another producer rank of P may still be writing
        into this rank's blocks: the recv ends once each is over too (cancelled and answered, or dead)."""
        self.ctx.peers.forget(peer)
        dead = {r for r, p in w.peers.items() if p.agent_name == peer.agent_name}
        for r in dead:
            del w.peers[r]
        w.over_ranks |= dead & w.producers
        w.fail_reason = f"{w.fail_reason}; prefill instance {peer.engine_id} (rank {peer.info.tp_rank}) is gone"
        live = w.producers - w.done_ranks - w.over_ranks  # producer ranks whose WRITE may still land
        if not live or w.state in (WaitState.HANDSHAKE, WaitState.DELAYED):
            self._end(rid, w, w.unlanded_end, w.fail_reason)
        elif w.state is WaitState.REGISTERED:
            self._start_cancel(rid, w, CancelWhy.TIMEOUT, w.fail_reason)
        # CANCELLING: the live producers' answers (or their deaths) end it

    def _end(self, rid: str, w: Wait, kind: RecvEnd, reason: str) -> None:
        """Nothing more can land in this recv's blocks: report it, exactly once."""
        del self.waits[rid]
        del self.by_key[w.key]
        if kind is RecvEnd.FINISHED:  # the WRITE's duration is P's to record; D only waited (every PushDone came)
            landed = landed_from(self.ctx, w.task, w.peers[0].info.geometry.block_size)
            self.ctx.sink.recv_finished(rid, w.num_bytes, None, landed, w.first_token)
        elif kind is RecvEnd.CANCELLED:
            self.ctx.sink.recv_cancelled(rid)
        else:
            log.warning("push recv %s failed: %s", rid, reason)
            self.ctx.sink.recv_failed(rid, reason)

    def progress(self, now: float) -> bool:
        return any(w.state in (WaitState.REGISTERED, WaitState.CANCELLING) for w in self.waits.values())
