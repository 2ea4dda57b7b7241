"""The side channel with a deployment secret (transfer/thread/handshake.py): both ends prove the secret, a
refusal reveals nothing, nonces are single-use; idle connections are closed and open connections capped."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.transfer import wire
from pdserve.transfer.thread import handshake
from pdserve.transfer.thread.handshake import SideChannel, SideChannelAuth

SECRET = b"k" * 32
SECRET_PONG = wire.Pong("engine-secret-id", "agent-secret-name", 1)


async def answer(msg: wire.Message) -> wire.Message:
    return SECRET_PONG if isinstance(msg, wire.Ping) else wire.Refused("?")


@pytest.fixture
def server() -> Iterator[SideChannel]:
    side = SideChannel("127.0.0.1", 0, SECRET)
    side.start(answer)
    yield side
    side.close()


def ask(client: SideChannel, port: int) -> tuple[wire.Message | None, str | None]:
    done = threading.Event()
    out: list = []
    client.request("127.0.0.1", port, wire.Ping(), 5.0, lambda r, e: (out.append((r, e)), done.set()))
    assert done.wait(10)
    return out[0]


def raw_exchange(port: int, frame: wire.Message) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        data = wire.encode(frame)
        s.sendall(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)


@pytest.mark.parametrize("client_secret", [SECRET, b"w" * 32, None])
def test_only_holders_of_the_secret_get_an_answer(server: SideChannel, client_secret: bytes | None) -> None:
    client = SideChannel("127.0.0.1", 0, client_secret)
    client.start(answer)
    try:
        reply, error = ask(client, server.port)
    finally:
        client.close()
    if client_secret == SECRET:
        assert reply == SECRET_PONG and error is None
    else:
        assert reply is None and "refused" in error and "not authenticated" in error


def test_refusals_reveal_nothing_and_nonces_are_single_use(server: SideChannel) -> None:
    sealed = SideChannelAuth(SECRET).seal_request(wire.Ping())
    first = wire.decode(raw_exchange(server.port, sealed))
    assert isinstance(first, wire.Sealed)
    for frame in (sealed, wire.Ping(), SideChannelAuth(b"w" * 32).seal_request(wire.Ping())):
        raw = raw_exchange(server.port, frame)  # a replay, a plain frame, another secret
        assert isinstance(wire.decode(raw), wire.Refused)
        assert b"engine-secret-id" not in raw and b"agent-secret-name" not in raw


def test_a_client_checks_the_server(server: SideChannel) -> None:
    # a server without the secret (or an impostor) cannot produce the reply MAC over the client's nonce
    auth = SideChannelAuth(SECRET)
    request = auth.seal_request(wire.Ping())
    fake = wire.Sealed(request.nonce, request.ts_ms, "0" * 64, wire.encode(SECRET_PONG))
    with pytest.raises(handshake.PeerRefused):
        auth.open_reply(request, fake)
    with pytest.raises(handshake.PeerRefused):
        auth.open_reply(request, SECRET_PONG)


def test_idle_connections_closed_and_connections_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "IDLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(handshake, "MAX_CONNECTIONS", 3)
    side = SideChannel("127.0.0.1", 0, SECRET)
    side.start(answer)
    try:
        held = [socket.create_connection(("127.0.0.1", side.port), timeout=5) for _ in range(3)]
        for s in held:
            s.sendall(b"\x00\x00")  # half a length prefix, never finished
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", side.port), timeout=5)
        assert extra.recv(1) == b""  # past the cap: closed at once
        extra.close()
        time.sleep(0.5)
        for s in held:
            assert s.recv(1) == b""  # idle past IDLE_TIMEOUT_S: closed
            s.close()
        sealed = SideChannelAuth(SECRET).seal_request(wire.Ping())
        assert isinstance(wire.decode(raw_exchange(side.port, sealed)), wire.Sealed)  # served again
    finally:
        side.close()


def test_a_port_in_use_is_refused_with_what_to_do(server: SideChannel) -> None:
    """Two instances on one host with the default port: the second one's error says how to start both."""
    with pytest.raises(OSError, match=r"cannot bind 127\.0\.0\.1:\d+: .*--kv-side-channel-port, or 0 for a free one"):
        SideChannel("127.0.0.1", server.port)
