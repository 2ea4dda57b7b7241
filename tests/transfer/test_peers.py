"""Peers.connect_ranks (transfer/thread/peers.py) over a fake side channel: the callback fires exactly once per
call, whether the ranks' handshakes are answered later (the first request) or at once from the cache (every
later request). A cached rank 0 answers inside connect(), and its on_rank re-entered on_rank for the cached
ranks 1..: the set was complete twice, so D registered twice with every P rank of TP >= 2 and P refused the
second registration ("attempt 0 is superseded by attempt 0", issue 25) — only from the second request on."""

from __future__ import annotations

from typing import Any, cast

import pytest

from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer.thread.peers import Peer, Peers
from pdserve.transfer.wire import WIRE_VERSION, HandshakeReply, PeerInfo


def _info(rank: int, tp: int, ports: list[int]) -> PeerInfo:
    geometry = CacheGeometry.of((), 2, 2 // tp, 4, 4, 4, 16, 2)
    return PeerInfo(engine_id="p", agent_name=f"p-r{rank}", agent_metadata=b"md", model_name="m", dtype="float32",
                    transfer_mode="push", wire_version=WIRE_VERSION, geometry=geometry, base_addr=1 << 40,
                    device_id=0, memory="DRAM", tp_rank=rank, tp_size=tp, rank_ports=ports if rank == 0 else [],
                    compat_hash="", epoch=1)  # fmt: skip


class FakeSide:
    """Records handshake requests; the test answers them (later, as the side channel's thread would)."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, Any]] = []  # (port, on_reply)

    def request(self, host: str, port: int, req: object, timeout: float, on_reply: Any) -> None:
        self.pending.append((port, on_reply))


class FakeAgent:
    def add_peer(self, metadata: bytes) -> str:
        return self.names.pop(0)

    def __init__(self) -> None:
        self.names: list[str] = []


class InlineLoop:
    def post(self, fn: Any) -> None:
        fn()

    def call_at(self, t: float, fn: Any) -> None:
        pass


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_connect_ranks_calls_back_once_fresh_and_cached(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ports = [5600 + r for r in range(tp)]
    side, agent = FakeSide(), FakeAgent()
    agent.names = [f"p-r{r}" for r in range(tp)]
    local = _info(0, 1, [])
    peers = Peers(cast(Any, agent), local, cast(Any, side), cast(Any, InlineLoop()))
    monkeypatch.setattr("pdserve.transfer.thread.peers.incompatibility", lambda a, b: None)
    calls: list[dict[int, Peer] | None] = []
    peers.connect_ranks("127.0.0.1", ports[0], "p", True, lambda p, e: calls.append(p))
    # first request: each rank's handshake is answered later, rank 0 first (it announces the others' ports)
    while side.pending:
        port, on_reply = side.pending.pop(0)
        on_reply(HandshakeReply(ok=True, peer=_info(ports.index(port), tp, ports), error=""), None)
    assert len(calls) == 1 and calls[0] is not None and sorted(calls[0]) == list(range(tp))
    # every later request: all ranks cached, answered inside connect_ranks
    for _ in range(3):
        calls.clear()
        peers.connect_ranks("127.0.0.1", ports[0], "p", True, lambda p, e: calls.append(p))
        assert not side.pending
        assert len(calls) == 1, f"callback called {len(calls)} times for cached ranks"
        assert calls[0] is not None and sorted(calls[0]) == list(range(tp))
