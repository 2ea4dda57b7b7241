"""Remote agents an instance talks to: handshakes (cached per address), loading metadata, liveness.

Transfer thread only. Handshakes run on the side-channel thread; their replies come back here as posted
commands, so the transfer thread never waits on the network.

Liveness: every heartbeat_s each producer this instance handshook with (cached per address) is pinged on its
side channel. A peer that refuses the connection, answers as another process (agent name or epoch differ:
restarted at the same address) or stays silent for peer_timeout_s is dead: it is forgotten (the next request
handshakes afresh, at no extra cost) and every on_dead callback runs, so the modes fail (or recompute) the
requests waiting on it at once. A cached peer that restarts is so dropped before the next request uses it.

Silence is judged leniently, because a live peer starved of CPU answers late and a wrong "dead" fails every
request waiting on it (a 2-core machine lost 5 of 18): any sign of life counts (a Pong, a handshake, and any
NIXL notification from its agent: only that process sends under that name); a Ping waits for its Pong until
the peer would be declared dead anyway (not a shorter probe timeout that drops an answer on its way); and time
this instance itself did not run (its heartbeat timer came late) is not counted as the peer's silence. None of
these delays noticing a peer that is gone: its side channel refuses at once, a restarted one answers with
another epoch, and a silent one is still dead after peer_timeout_s of this instance's own running time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.transfer.thread.agent import AgentError, NixlAgent
from pdserve.transfer.thread.handshake import REFUSED, SideChannel
from pdserve.transfer.thread.loop import TransferLoop
from pdserve.transfer.wire import HandshakeReply, HandshakeRequest, Message, PeerInfo, Ping, Pong
from pdserve.transfer.wire_compat import incompatibility

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0

PeerCallback = Callable[["Peer | None", "str | None"], None]  # (peer, error) — exactly one is None
RanksCallback = Callable[["dict[int, Peer] | None", "str | None"], None]  # (peer per rank, error)


@dataclass
class Peer:
    info: PeerInfo  # who it is and where its KV cache is (info.geometry, info.base_addr: in its process)
    alive_at: float = field(default_factory=time.monotonic)  # last handshake or Pong from this process
    pinging: bool = False  # a heartbeat Ping is in flight

    @property
    def agent_name(self) -> str:
        return self.info.agent_name

    @property
    def engine_id(self) -> str:
        return self.info.engine_id


class Peers:
    """Owned by the transfer thread's context; uses the agent, this instance's handshake payload, the side
    channel (handshakes and probes, answered on its thread) and the loop (to bring answers back here)."""

    def __init__(
        self,
        agent: NixlAgent,
        local: PeerInfo,
        side: SideChannel,
        loop: TransferLoop,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 4.0,
    ) -> None:
        self.agent, self.local, self.side, self.loop = agent, local, side, loop
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self._by_addr: dict[tuple[str, int], Peer] = {}  # producers we handshook with
        self._by_agent: dict[str, Peer] = {}  # every loaded remote agent
        self._waiting: dict[tuple[str, int], list[tuple[str | None, PeerCallback]]] = {}  # handshakes in flight
        self.on_dead: list[Callable[[Peer], None]] = []  # the modes' reactions to a dead peer (transfer thread)
        self._beating = False  # the heartbeat timer chain runs (while _by_addr is not empty)
        self._beat_due = 0.0  # time.monotonic() the next heartbeat is due (later than that: we did not run)

    def by_agent(self, agent_name: str) -> Peer | None:
        return self._by_agent.get(agent_name)

    # ---- outgoing handshakes ----------------------------------------------------------------------------------------
    def connect(
        self, host: str, port: int, engine_id: str | None, load_me: bool, callback: PeerCallback, fresh: bool = False
    ) -> None:
        """Handshake with the instance at host:port once (cached; fresh=True handshakes again, so a peer that
        forgot us loads us again) and load its agent; callback(peer, None) or callback(None, error) later on
        this thread. engine_id, if given, must match the peer's."""
        key = (host, port)
        peer = self._by_addr.get(key)
        if peer is not None and not fresh and (engine_id is None or engine_id == peer.engine_id):
            callback(peer, None)
            return
        waiters = self._waiting.setdefault(key, [])
        waiters.append((engine_id, callback))
        if len(waiters) > 1:
            return  # a handshake with this address is already in flight
        req = HandshakeRequest(self.local, load_me)
        self.side.request(
            host, port, req, HANDSHAKE_TIMEOUT_S, lambda r, e: self.loop.post(lambda: self._on_reply(key, r, e))
        )

    def connect_ranks(
        self, host: str, port: int, engine_id: str | None, load_me: bool, callback: RanksCallback
    ) -> None:
        """Handshake with every tensor-parallel rank of the instance whose rank 0 listens at host:port: rank 0
        first (its handshake lists every rank's side-channel port, on its host), then the others, each cached
        like connect(); callback({rank: peer}, None) once all answered, or callback(None, error) at the first
        failure. Every rank must say it is that rank of the same engine and TP size."""
        peers: dict[int, Peer] = {}
        over: list[bool] = []  # callback was called (every rank answered, or the first failure): nothing more

        def on_rank(rank: int, peer: Peer | None, error: str | None) -> None:
            if over:
                return
            size = peers[0].info.tp_size if rank else (peer.info.tp_size if peer is not None else 1)
            if peer is not None and (peer.info.tp_rank != rank or peer.info.tp_size != size):
                error = (f"{host}: the handshake of rank {rank} says rank {peer.info.tp_rank} of {peer.info.tp_size}, "
                         f"rank 0 announced {size} ranks")  # fmt: skip
            elif peer is not None and rank == 0 and size > 1 and len(peer.info.rank_ports) != size:
                error = f"{host}: rank 0 announced {size} ranks but {len(peer.info.rank_ports)} side-channel ports"
            if error is not None or peer is None:
                over.append(True)
                callback(None, error)
                return
            peers[rank] = peer
            if rank == 0:  # a cached rank answers inside connect(), re-entering on_rank: it may complete the set
                for r in range(1, size):
                    self.connect(host, peer.info.rank_ports[r], peer.engine_id, load_me, rank_callback(r))
            if len(peers) == size and not over:
                over.append(True)
                callback(dict(peers), None)

        def rank_callback(rank: int) -> PeerCallback:
            return lambda p, e: on_rank(rank, p, e)

        self.connect(host, port, engine_id, load_me, rank_callback(0))

    def _on_reply(self, key: tuple[str, int], reply: Message | None, error: str | None) -> None:
        waiters = self._waiting.pop(key, [])
        peer = None
        if error is None:
            peer, error = self._accept_reply(key, reply)
        for engine_id, cb in waiters:
            if peer is not None and engine_id is not None and engine_id != peer.engine_id:
                cb(None, f"{key[0]}:{key[1]} is engine {peer.engine_id!r}, not {engine_id!r} (restarted?)")
            else:
                cb(peer, error)

    def _accept_reply(self, key: tuple[str, int], reply: Message | None) -> tuple[Peer | None, str | None]:
        if not isinstance(reply, HandshakeReply):
            return None, f"unexpected handshake reply {type(reply).__name__}"
        err = incompatibility(self.local, reply.peer) if reply.peer is not None else None
        if err is not None:  # (also when the peer refused us for it: word it from this side)
            return None, err
        if not reply.ok or reply.peer is None:
            return None, f"handshake refused by {key[0]}:{key[1]}: {reply.error}"
        try:
            peer = self._load(reply.peer)
        except AgentError as e:
            return None, str(e)
        old = self._by_addr.get(key)
        if old is not None and old.agent_name != peer.agent_name:
            self._dead(old, f"{key[0]}:{key[1]} answers as another process (restarted)")
        peer.alive_at = time.monotonic()
        self._by_addr[key] = peer
        self._start_heartbeats()
        return peer, None

    # ---- incoming handshakes ----------------------------------------------------------------------------------------
    def accept(self, info: PeerInfo) -> None:
        """Load a consumer's agent announced in its handshake (push: P writes into it). Raises AgentError."""
        self._load(info)

    def _load(self, info: PeerInfo) -> Peer:
        peer = self._by_agent.get(info.agent_name)
        if peer is None:
            name = self.agent.add_peer(info.agent_metadata)
            if name != info.agent_name:
                log.warning("agent metadata names %r, handshake said %r", name, info.agent_name)
            info = replace(info, agent_name=name, agent_metadata=b"")  # the metadata is not needed again
            peer = Peer(info)
            self._by_agent[name] = peer
        return peer

    def forget(self, peer: Peer) -> None:
        """Drop a peer that died or was replaced; the next request handshakes afresh."""
        if self._by_agent.pop(peer.agent_name, None) is None:
            return
        self._by_addr = {k: p for k, p in self._by_addr.items() if p is not peer}
        self.agent.remove_peer(peer.agent_name)
        log.info("forgot peer %s (%s)", peer.engine_id, peer.agent_name)

    # ---- liveness -----------------------------------------------------------------------------------------------
    def heard_from(self, agent_name: str, now: float) -> None:
        """A notification from this agent arrived: its process is alive (a restarted one has another name)."""
        peer = self._by_agent.get(agent_name)
        if peer is not None:
            peer.alive_at = max(peer.alive_at, now)

    def _start_heartbeats(self) -> None:
        if not self._beating:
            self._beating = True
            self._beat_due = time.monotonic() + self.heartbeat_s
            self.loop.call_at(self._beat_due, self._heartbeat)

    def _heartbeat(self) -> None:
        """Ping every cached producer; declare dead those silent for peer_timeout_s of our own running time."""
        now = time.monotonic()
        stalled = now - self._beat_due  # this thread ran this late: nobody here listened meanwhile
        for key, peer in list(self._by_addr.items()):
            if stalled > self.heartbeat_s:
                peer.alive_at = min(now, peer.alive_at + stalled)
            if now - peer.alive_at > self.peer_timeout_s:
                self._dead(peer, f"silent (no Pong, no notification) for {now - peer.alive_at:.1f} s")
            elif not peer.pinging:
                peer.pinging = True
                self.probe(key[0], key[1], peer, self._beat_callback(peer))
        self._beating = bool(self._by_addr)
        if self._beating:
            self._beat_due = now + self.heartbeat_s
            self.loop.call_at(self._beat_due, self._heartbeat)

    def _beat_callback(self, peer: Peer) -> Callable[[bool | None], None]:
        return lambda alive: self._on_beat(peer, alive)

    def _on_beat(self, peer: Peer, alive: bool | None) -> None:
        peer.pinging = False
        if alive:
            peer.alive_at = time.monotonic()
        elif alive is False and self._by_agent.get(peer.agent_name) is peer:
            self._dead(peer, "its side channel refuses or another process answers there")

    def _dead(self, peer: Peer, why: str) -> None:
        if self._by_agent.get(peer.agent_name) is not peer:
            return  # forgotten already
        log.warning("peer %s (%s) is dead: %s", peer.engine_id, peer.agent_name, why)
        self.forget(peer)
        for callback in self.on_dead:
            callback(peer)

    def probe(self, host: str, port: int, peer: Peer, callback: Callable[[bool | None], None]) -> None:
        """Is peer's agent still alive? callback(False) when its side channel refuses or another agent
        answers there (the process is gone), True when it answers, None when unknown (no answer within
        peer_timeout_s: by then the heartbeat has judged it on its silence anyway)."""

        def on_reply(reply: Message | None, error: str | None) -> None:
            if isinstance(reply, Pong):
                alive: bool | None = reply.agent_name == peer.agent_name and reply.epoch == peer.info.epoch
            else:
                alive = False if error and REFUSED in error else None
            self.loop.post(lambda: callback(alive))

        self.side.request(host, port, Ping(), self.peer_timeout_s, on_reply)
