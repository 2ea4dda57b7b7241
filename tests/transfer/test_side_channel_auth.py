"""The side channel with a deployment secret (transfer/thread/handshake.py): both ends prove the secret, a
refusal reveals nothing, nonces are single-use; connections must send their first frame within a deadline, a
flood of idle connections (from a stranger's address or the peer's own) never locks a peer out, refusals are
counted and logged as one line, not one per connection (side_admission.py); the client reuses its connection."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.transfer import wire
from pdserve.transfer.thread import handshake
from pdserve.transfer.thread.handshake import SideChannel, SideChannelAuth
from pdserve.transfer.thread.side_admission import Admission

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


def wait_closed(s: socket.socket, timeout_s: float = 5.0) -> bool:
    """The server closed s (EOF or reset) within timeout_s."""
    s.settimeout(timeout_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def small_server(secret: bytes | None = SECRET, pending: int = 8, per_source: int = 4, admitted: int = 4):
    side = SideChannel("127.0.0.1", 0, secret)
    side.admission = Admission(pending, per_source, admitted)
    side.start(answer)
    return side


def test_first_frame_deadline_idle_timeout_and_refusal_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "FIRST_FRAME_TIMEOUT_S", 0.3)
    monkeypatch.setattr(handshake, "IDLE_TIMEOUT_S", 0.5)
    side = small_server()
    try:
        t0 = time.monotonic()
        half = socket.create_connection(("127.0.0.1", side.port), timeout=5)
        half.sendall(b"\x00\x00")  # half a length prefix, never finished: closed at the first-frame deadline
        assert wait_closed(half) and time.monotonic() - t0 < 3.0
        # a valid first frame is admitted; then idle past IDLE_TIMEOUT_S: closed
        s = socket.create_connection(("127.0.0.1", side.port), timeout=5)
        data = wire.encode(SideChannelAuth(SECRET).seal_request(wire.Ping()))
        s.sendall(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        assert isinstance(wire.decode(s.recv(n, socket.MSG_WAITALL)), wire.Sealed)
        assert wait_closed(s)
        # a refused request is answered, then its connection is closed (it holds no slot)
        r = socket.create_connection(("127.0.0.1", side.port), timeout=5)
        data = wire.encode(wire.Ping())
        r.sendall(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", r.recv(4, socket.MSG_WAITALL))
        assert isinstance(wire.decode(r.recv(n, socket.MSG_WAITALL)), wire.Refused)
        assert wait_closed(r)
        for sock in (half, s, r):
            sock.close()
        counts = side.refusal_counts()
        assert counts["first_frame_timeout"] == 1 and counts["unauthenticated"] == 1, counts
    finally:
        side.close()


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["stranger-address", "the-peer's-address"])
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_a_flood_of_idle_connections_never_locks_a_peer_out(
    source: str, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Far more idle connections than every limit, held open: a peer's new connection still gets in (the
    oldest silent one gives way), a pooled one is never touched; one log line, not one per refusal."""
    side = small_server(secret)
    client = SideChannel("127.0.0.1", 0, secret)
    client.start(answer)
    flood: list[socket.socket] = []
    try:
        for _ in range(60):
            flood.append(socket.create_connection(("127.0.0.1", side.port), timeout=5, source_address=(source, 0)))
        for _ in range(5):  # a new client each time: a new connection through the flooded pending slots
            fresh = SideChannel("127.0.0.1", 0, secret)
            fresh.start(answer)
            try:
                assert ask(fresh, side.port) == (SECRET_PONG, None)
            finally:
                fresh.close()
        assert ask(client, side.port) == (SECRET_PONG, None)  # its connection is pooled from here on
        for _ in range(60):  # more of the flood while the client holds its pooled (admitted) connection
            flood.append(socket.create_connection(("127.0.0.1", side.port), timeout=5, source_address=(source, 0)))
        for _ in range(5):
            assert ask(client, side.port) == (SECRET_PONG, None)
        assert side.admission.num_pending <= 8 and side.admission.num_admitted <= 4
        assert side.refusal_counts()["evicted"] >= 100
        lines = [r for r in caplog.records if "refused connections" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    finally:
        for s in flood:
            s.close()
        client.close()
        side.close()


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["stranger-address", "the-peer's-address"])
def test_half_sent_frames_never_lock_a_peer_out(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pending connections that each sent part of a frame (and would hold their slots until the first-frame
    deadline) fill every pending slot: a peer's new connection still gets in, the oldest of them giving way."""
    monkeypatch.setattr(handshake, "FIRST_FRAME_TIMEOUT_S", 60.0)  # only an eviction may close them here
    side = small_server(pending=3, per_source=3)
    client = SideChannel("127.0.0.1", 0, SECRET)
    client.start(answer)
    talking: list[socket.socket] = []
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", side.port), timeout=5, source_address=(source, 0))
            s.sendall(b"\x00\x00")  # half a length prefix
            talking.append(s)
        deadline = time.monotonic() + 10  # the server accepts them on its own thread
        while side.admission.num_pending < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert side.admission.num_pending == 3
        assert ask(client, side.port) == (SECRET_PONG, None)
        assert wait_closed(talking[0])  # the oldest half-sent one was closed for the peer's connection
        assert side.refusal_counts().get("evicted") == 1 and "full" not in side.refusal_counts()
    finally:
        for s in talking:
            s.close()
        client.close()
        side.close()


def test_the_client_reuses_its_connection_and_survives_its_closing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "IDLE_TIMEOUT_S", 0.3)
    side = small_server()
    client = SideChannel("127.0.0.1", 0, SECRET)
    client.start(answer)
    try:
        for _ in range(3):
            assert ask(client, side.port) == (SECRET_PONG, None)
        assert side.admission.num_admitted == 1  # one connection served all three
        time.sleep(0.6)  # the server closed it meanwhile: the next request goes on a new one
        assert ask(client, side.port) == (SECRET_PONG, None)
    finally:
        client.close()
        side.close()


def test_a_port_in_use_is_refused_with_what_to_do(server: SideChannel) -> None:
    """Two instances on one host with the default port: the second one's error says how to start both."""
    with pytest.raises(OSError, match=r"cannot bind 127\.0\.0\.1:\d+: .*--kv-side-channel-port, or 0 for a free one"):
        SideChannel("127.0.0.1", server.port)


def test_admitted_slots_close_the_idlest_and_refuse_only_when_all_are_answering() -> None:
    """Admission alone (pure Python, its own clock): past max_admitted the admitted connection idle longest is
    closed for a new one; when every admitted connection is answering a frame, the new one is refused (full)."""
    now = [0.0]
    adm = Admission(max_pending=4, max_pending_per_source=4, max_admitted=2, clock=lambda: now[0])
    closed: list[str] = []

    def slot(name: str) -> Any:
        return adm.open("10.0.0.1", lambda: closed.append(name), lambda: True)

    a, b = slot("a"), slot("b")
    assert adm.admit(a)
    now[0] = 1.0
    assert adm.admit(b) and adm.num_admitted == 2
    c = slot("c")
    assert adm.admit(c) and closed == ["a"]  # a was idle longest
    b.busy = c.busy = True
    d = slot("d")
    assert not adm.admit(d) and adm.counts() == {"full": 1}  # nobody to close: refused
    assert adm.num_admitted == 2 and closed == ["a"]
