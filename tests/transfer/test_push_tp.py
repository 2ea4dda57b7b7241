"""P's push rendezvous with a decode instance of TP 2 (push_send.SendSide), over fakes of the agent, peers, timers
and result sink, so every per-D-rank path runs in milliseconds: each D rank's registration gets its own WRITE
(the heads it takes from this P rank) with its own PushDone; cancels, PushQueued keepalives, PushFail and
abandoned transfers go to the D rank they concern; P's blocks are freed only when every D rank's part is over.
And D's side (push_recv.RecvSide) when one of two producer ranks dies. tiny model: 2 KV heads; P is TP 1
(holds both), D is TP 2 (one head per rank); for D's side, P TP 2 -> D TP 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from pdserve.config import TransferConfig
from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.params import PushSource
from pdserve.transfer.base import KVCacheSpec, RecvTask, SendTask
from pdserve.transfer.thread.agent import Xfer, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.thread.push_recv import RecvSide
from pdserve.transfer.thread.push_send import SendSide
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire import WIRE_VERSION, Message, PeerInfo, decode
from pdserve.transfer.wire_notifs import PushCancel, PushCancelAck, PushDone, PushFail, PushQueued, PushRegister

HEADS, HEAD_DIM, ELEM, LAYERS, BLOCK, BLOCKS = 2, 4, 4, 2, 4, 16


def _geometry(heads: int) -> CacheGeometry:
    return CacheGeometry.of((), LAYERS, heads, HEAD_DIM, ELEM, BLOCK, BLOCKS, HEADS)


def _info(rank: int, tp: int) -> PeerInfo:
    return PeerInfo(engine_id="d", agent_name=f"d-r{rank}", agent_metadata=b"", model_name="m", dtype="float32",
                    transfer_mode="push", wire_version=WIRE_VERSION, geometry=_geometry(HEADS // tp),
                    base_addr=1 << 40, device_id=0, memory="DRAM", tp_rank=rank, tp_size=tp, rank_ports=[],
                    compat_hash="", epoch=1)  # fmt: skip


@dataclass
class Fakes:
    """The agent, peers, timer loop and result sink SendSide talks to, recording what it does."""

    peers: dict[str, Peer] = field(default_factory=dict)  # agent name -> peer
    notifs: list[tuple[str, Message]] = field(default_factory=list)  # (to agent, message), WRITE notifs included
    posts: list[Xfer] = field(default_factory=list)
    timers: list[tuple[float, Any]] = field(default_factory=list)
    sends: list[tuple[str, SendOutcome]] = field(default_factory=list)

    # agent
    def send_notif(self, name: str, data: bytes) -> None:
        self.notifs.append((name, decode(data)))

    def post(self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes, memory: str) -> Xfer:
        self.notifs.append((peer, decode(notif)))  # delivered after the data: tests check it with the WRITE
        xfer = Xfer(len(self.posts), peer, int(local[:, 1].sum()), XferState.PROC, len(local))
        self.posts.append(xfer)
        return xfer

    def check(self, xfer: Xfer) -> XferState:
        return xfer.state

    # peers
    def by_agent(self, name: str) -> Peer | None:
        return self.peers.get(name)

    def forget(self, peer: Peer) -> None:
        self.peers.pop(peer.agent_name, None)

    # thread
    def call_at(self, t: float, fn: Any) -> None:
        self.timers.append((t, fn))

    def run_timers(self, until: float) -> None:
        due, self.timers = [x for x in self.timers if x[0] <= until], [x for x in self.timers if x[0] > until]
        for _, fn in due:
            fn()

    # sink
    def send_finished(self, rid: str, outcome: SendOutcome, num_bytes: int = 0, seconds: float | None = None) -> None:
        self.sends.append((rid, outcome))

    def event(self, rid: str, name: str, t: float | None = None) -> None:
        pass

    def posted(self, num_descs: int, post_seconds: float) -> None:
        pass

    def to(self, name: str, kind: type) -> list[Any]:
        return [m for n, m in self.notifs if n == name and isinstance(m, kind)]


def _side(lease_s: float = 30.0) -> tuple[SendSide, Fakes]:
    f = Fakes()
    spec = KVCacheSpec(_geometry(HEADS), 1 << 30, "DRAM", 0, "m", "float32")
    for rank in (0, 1):
        info = _info(rank, 2)
        f.peers[info.agent_name] = Peer(info)
    cfg = TransferConfig(role="prefill", mode="push", lease_s=lease_s)
    ctx = TransferContext(cfg, spec, cast(Any, f), cast(Any, None), cast(Any, None), cast(Any, f), cast(Any, f),
                          cast(Any, f))  # fmt: skip
    return SendSide(ctx), f


def _register(side: SendSide, rank: int, attempt: int = 0, tid: str = "t") -> None:
    msg = PushRegister(tid, attempt, "d", [rank + 1, rank + 2], BLOCK, 0, 6, rank, 1000, [])
    side.on_register(f"d-r{rank}", msg, 0.0)


def test_each_d_rank_gets_its_heads_and_p_frees_after_both() -> None:
    side, f = _side()
    _register(side, 0)
    side._add_send(SendTask("p1", (3, 4), 6, "t"), 0.0)
    assert len(f.posts) == 1 and f.sends == []  # D rank 1 has not registered: P keeps its blocks
    _register(side, 1)
    assert [x.peer for x in f.posts] == ["d-r0", "d-r1"]
    one_head = 8 * LAYERS * 2 * HEAD_DIM * ELEM  # tokens (6, the last block whole) x layers x K/V x one head
    assert [x.num_bytes for x in f.posts] == [one_head, one_head]
    for rank in (0, 1):
        (done,) = f.to(f"d-r{rank}", PushDone)
        assert (done.producer_rank, done.num_producers) == (0, 1)
    f.posts[0].state = XferState.DONE
    side.progress(0.0)
    assert f.sends == []  # D rank 1's WRITE is still in flight
    f.posts[1].state = XferState.DONE
    side.progress(0.0)
    assert f.sends == [("p1", SendOutcome.OK)] and side.rv == {}
    _register(side, 1, attempt=1)  # late: refused
    assert len(f.to("d-r1", PushFail)) == 1


def test_cancel_keepalive_and_abandon_are_per_d_rank() -> None:
    side, f = _side()
    side.on_expect("p1", "t", 0.0)
    _register(side, 0)
    _register(side, 1)
    assert len(f.to("d-r0", PushQueued)) == 1 and len(f.to("d-r1", PushQueued)) == 1
    side.on_cancel("d-r1", PushCancel("t", 0))
    (ack,) = f.to("d-r1", PushCancelAck)
    assert not ack.landed and f.to("d-r0", PushCancelAck) == []
    f.run_timers(time.monotonic() + 5)  # keepalives (every second): rank 0's registration only
    assert len(f.to("d-r0", PushQueued)) == 2 and len(f.to("d-r1", PushQueued)) == 1
    side.on_abandon("p1")
    assert len(f.to("d-r0", PushFail)) == 1 and f.to("d-r1", PushFail) == []


def test_a_failed_write_refuses_the_other_ranks_and_frees_once_nothing_is_in_flight() -> None:
    side, f = _side()
    _register(side, 0)
    side._add_send(SendTask("p1", (3, 4), 6, "t"), 0.0)
    f.posts[0].state = XferState.ERR
    side.progress(0.0)
    assert len(f.to("d-r0", PushFail)) == 1
    assert f.sends == [("p1", SendOutcome.FAILED)]  # nothing in flight: freed at once, D rank 1 never written
    _register(side, 1)
    assert len(f.to("d-r1", PushFail)) == 1 and len(f.posts) == 1


def test_write_in_flight_holds_the_blocks_after_another_rank_fails() -> None:
    side, f = _side()
    _register(side, 0)
    _register(side, 1)
    side._add_send(SendTask("p1", (3, 4), 6, "t"), 0.0)
    f.posts[1].state = XferState.ERR
    side.progress(0.0)
    assert f.sends == []  # D rank 0's WRITE still reads P's blocks: keep them
    side.on_register("d-r1", PushRegister("t", 1, "d", [5, 6], BLOCK, 0, 6, 1, 1000, []), 0.0)  # a retry: refused
    assert len(f.to("d-r1", PushFail)) == 2 and len(f.posts) == 2
    f.posts[0].state = XferState.DONE
    side.progress(0.0)
    assert f.sends == [("p1", SendOutcome.FAILED)]


def test_a_d_rank_that_never_registers_expires_the_send() -> None:
    side, f = _side(lease_s=5.0)
    _register(side, 0)
    side._add_send(SendTask("p1", (3, 4), 6, "t"), 0.0)
    f.posts[0].state = XferState.DONE
    side.progress(0.0)
    assert f.sends == []
    f.run_timers(1e12)  # lease_s passes
    assert f.sends == [("p1", SendOutcome.EXPIRED)]


# ---- D's side: a D rank written by two P ranks (P TP 2 -> D TP 1), one of which dies ---------------------------


@dataclass
class RecvFakes(Fakes):
    on_dead: list[Any] = field(default_factory=list)
    ends: list[tuple[str, str]] = field(default_factory=list)  # (request id, "failed: reason" | "cancelled" | ...)

    def connect_ranks(self, host: str, port: int, engine_id: str | None, load: bool, cb: Any) -> None:
        cb({rank: self.peers[f"p-r{rank}"] for rank in (0, 1)}, None)

    def probe(self, host: str, port: int, peer: Peer, cb: Any) -> None:
        cb(True)

    def recv_failed(self, rid: str, reason: str) -> None:
        self.ends.append((rid, f"failed: {reason}"))

    def recv_cancelled(self, rid: str) -> None:
        self.ends.append((rid, "cancelled"))

    def recv_finished(self, rid: str, num_bytes: int, seconds: float | None) -> None:
        self.ends.append((rid, "finished"))


def _recv_side() -> tuple[RecvSide, RecvFakes]:
    f = RecvFakes()
    for rank in (0, 1):
        info = replace(_info(rank, 2), engine_id="p", agent_name=f"p-r{rank}")
        f.peers[info.agent_name] = Peer(info)
    spec = KVCacheSpec(_geometry(HEADS), 1 << 30, "DRAM", 0, "m", "float32")
    cfg = TransferConfig(role="decode", mode="push")
    local = replace(_info(0, 1), engine_id="d")
    ctx = TransferContext(cfg, spec, cast(Any, f), local, cast(Any, None), cast(Any, f), cast(Any, f), cast(Any, f))
    side = RecvSide(ctx)
    side.on_recv(RecvTask("r1", (1, 2), 0, 6, PushSource("t", "127.0.0.1", 5600, "p")), 0.0)
    assert {n for n, m in f.notifs if isinstance(m, PushRegister)} == {"p-r0", "p-r1"}
    return side, f


def test_a_dead_p_rank_ends_the_recv_only_once_the_other_producers_write_is_over() -> None:
    side, f = _recv_side()
    for cb in f.on_dead:
        cb(f.peers["p-r1"])  # P rank 1 dies; P rank 0's WRITE may still land
    assert f.ends == [] and f.to("p-r0", PushCancel) != []
    side.on_ack(PushCancelAck("t", 0, 0, False))
    assert len(f.ends) == 1 and f.ends[0][1].startswith("failed:") and "(rank 1) is gone" in f.ends[0][1]


def test_a_dead_p_rank_after_the_others_landed_ends_the_recv_at_once() -> None:
    side, f = _recv_side()
    side.on_done(PushDone("t", 0, 0, 2, 100))
    for cb in f.on_dead:
        cb(f.peers["p-r1"])
    assert len(f.ends) == 1 and "(rank 1) is gone" in f.ends[0][1]
