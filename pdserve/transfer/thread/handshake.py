"""The side channel: a small TCP server and client for handshakes and liveness probes (msgpack frames).

Frames are a 4-byte big-endian length followed by one wire.py message; never pickle. One asyncio loop on
one thread ("side channel" thread) serves incoming requests and runs outgoing ones, so a slow or dead
peer never blocks the transfer thread: callers get their answer through a callback on this thread.
The listening socket is bound in the constructor (port 0 picks a free port; `port` is the bound one),
before the loop starts, so the address can be reported at once.

With a deployment secret every request and reply travels as a wire.Sealed (side_auth.py): the client proves
the secret, the server checks it before the handler sees anything and proves it back. A request that fails gets
a wire.Refused naming the check and nothing else (no engine id, agent metadata, address or layout). Without a
secret frames are plain (and a Sealed is refused).

Limits (side_admission.py): a new connection must send a complete, valid first frame within
FIRST_FRAME_TIMEOUT_S before it holds one of the admitted slots; pending connections are capped in all and per
source address, the oldest silent one giving way to a newer one; an admitted connection that sends no frame for
IDLE_TIMEOUT_S is closed; a request that fails authentication is answered Refused and its connection closed.
Refusals are counted, not logged one by one. The client keeps its connection to a peer open for the next
request (at most POOL_PER_ADDRESS idle per address, for POOL_IDLE_S), so a peer's pings and handshakes travel on
an admitted connection and never wait behind strangers for a pending slot.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import socket
import struct
import termios
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import SupportsIndex

from pdserve.transfer.thread.netdev import advertised_address
from pdserve.transfer.thread.side_admission import (
    FIRST_FRAME_TIMEOUT,
    FIRST_FRAME_TIMEOUT_S,
    MALFORMED,
    UNAUTHENTICATED,
    Admission,
)
from pdserve.transfer.thread.side_auth import PeerRefused, SideChannelAuth
from pdserve.transfer.wire import MAX_MESSAGE_BYTES, Message, Refused, Sealed, WireError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[Message], Awaitable[Message]]
ReplyCallback = Callable[[Message | None, str | None], None]  # (reply, error) — exactly one is None
_LEN = struct.Struct(">I")
REFUSED = "refused the connection (nothing listens there)"  # in errors: the peer process is gone
IDLE_TIMEOUT_S = 10.0  # an admitted connection with no complete frame for this long is closed
POOL_IDLE_S = IDLE_TIMEOUT_S / 2  # the client reuses an idle connection this long (before the server closes it)
POOL_PER_ADDRESS = 2  # idle connections the client keeps per peer address


async def read_frame(reader: asyncio.StreamReader) -> Message:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"frame of {n} bytes is larger than {MAX_MESSAGE_BYTES}")
    return decode(await reader.readexactly(n))


async def write_frame(writer: asyncio.StreamWriter, msg: Message) -> None:
    data = encode(msg)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


class _Reader(asyncio.StreamReader):
    """A StreamReader that remembers whether any byte arrived (a pending connection that sent something is
    not silent: side_admission never evicts it)."""

    got_data = False

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.got_data = self.got_data or bool(data)
        super().feed_data(data)


def _has_data(reader: _Reader, writer: asyncio.StreamWriter) -> bool:
    """Bytes arrived on this connection: read already, or waiting in the kernel (FIONREAD)."""
    if reader.got_data:
        return True
    sock = writer.get_extra_info("socket")
    try:
        return sock is not None and struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0] > 0
    except OSError:
        return False


class SideChannel:
    def __init__(self, host: str, port: int, secret: bytes | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            hint = ""
            if e.errno == errno.EADDRINUSE:
                hint = (" (another instance on this host? give each its own --kv-side-channel-port, or 0 for a"
                        " free one: peers learn it from the kv_transfer_params and /kv_transfer/info)")  # fmt: skip
            raise OSError(f"side channel cannot bind {host}:{port}: {e}{hint}") from None
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.host = advertised_address(host)  # what peers dial (and UCX's interface)
        self.port: int = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._auth = SideChannelAuth(secret) if secret else None
        self.admission = Admission()  # who holds the served connections; refusal counters (side-channel thread)
        # the client's idle connections per peer address, with time.monotonic() each was last used
        self._pool: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}

    def refusal_counts(self) -> dict[str, int]:
        """Connections and requests refused since start, by reason (side_admission.py); any thread."""
        return self.admission.counts()

    # ---- life cycle ---------------------------------------------------------------------------------------------
    def start(self, handler: Handler) -> None:
        """Start the side-channel thread serving requests with handler (called on that thread)."""
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name="pdserve-side-channel", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        protocol = lambda: asyncio.StreamReaderProtocol(_Reader(loop=loop), self._serve)  # noqa: E731
        self._server = loop.run_until_complete(loop.create_server(protocol, sock=self._sock))
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for conns in self._pool.values():
                for _, writer, _ in conns:
                    writer.close()
            loop.run_until_complete(self._server.wait_closed())
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def close(self) -> None:
        """Stop serving and join the thread (pending client callbacks are not called)."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop = self._thread = None
        else:
            self._sock.close()

    # ---- server -------------------------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        assert isinstance(reader, _Reader)
        slot = self.admission.open(source, writer.close, lambda: _has_data(reader, writer))
        try:
            try:
                frame = await asyncio.wait_for(read_frame(reader), FIRST_FRAME_TIMEOUT_S)
            except TimeoutError:
                self.admission.refuse(FIRST_FRAME_TIMEOUT)
                return
            while True:
                msg = self._open(frame)
                if isinstance(msg, Refused):  # answered, then closed: a refused connection holds no slot
                    self.admission.refuse(UNAUTHENTICATED)
                    await write_frame(writer, msg)
                    return
                if not slot.admitted and not self.admission.admit(slot):
                    return
                slot.busy = True
                await write_frame(writer, await self._reply(frame, msg))
                slot.busy, slot.idle_since = False, time.monotonic()
                try:
                    frame = await asyncio.wait_for(read_frame(reader), IDLE_TIMEOUT_S)
                except TimeoutError:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client closed the connection (or it was closed for a newer one)
        except WireError:
            self.admission.refuse(MALFORMED)
        except Exception:
            log.exception("side channel: handler failed for a request from %s", peer)
        finally:
            self.admission.release(slot)
            writer.close()

    def _open(self, frame: Message) -> Message:
        """The request inside a client's frame, or the Refused to answer it with (naming only the check)."""
        if self._auth is None:
            if isinstance(frame, Sealed | Refused):
                return Refused("this instance has no deployment secret; the deployment disagrees on it")
            return frame
        try:
            return self._auth.open_request(frame)
        except PeerRefused as e:
            return Refused(str(e))
        except WireError:
            return Refused("not authenticated: malformed frame")

    async def _reply(self, frame: Message, msg: Message) -> Message:
        """The handler's answer to an opened request (sealed when there is a secret)."""
        reply = await self._handler(msg)
        if self._auth is None:
            return reply
        assert isinstance(frame, Sealed)
        return self._auth.seal_reply(frame, reply)

    # ---- client -------------------------------------------------------------------------------------------------
    def request(self, host: str, port: int, msg: Message, timeout_s: float, callback: ReplyCallback) -> None:
        """Send msg to host:port and call callback(reply, None) or callback(None, error) on the side-channel
        thread. Thread-safe; never blocks."""
        loop = self._loop
        if loop is None:
            callback(None, "side channel is not running")
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self._ask(host, port, msg, timeout_s, callback)))

    async def _ask(self, host: str, port: int, msg: Message, timeout_s: float, callback: ReplyCallback) -> None:
        try:
            reply = await asyncio.wait_for(self._exchange(host, port, msg), timeout_s)
        except TimeoutError:
            callback(None, f"side channel {host}:{port} did not answer within {timeout_s:g} s")
        except ConnectionRefusedError:
            callback(None, f"side channel {host}:{port} {REFUSED}")
        except (OSError, asyncio.IncompleteReadError) as e:
            callback(None, f"side channel {host}:{port} unreachable: {e}")
        except WireError as e:
            callback(None, f"side channel {host}:{port} sent a malformed reply: {e}")
        except PeerRefused as e:
            callback(None, f"side channel {host}:{port} refused: {e}")
        else:
            callback(reply, None)

    async def _exchange(self, host: str, port: int, msg: Message) -> Message:
        """One request and its reply, on an idle pooled connection to host:port if there is one (one the server
        closed meanwhile is retried once on a new connection), else on a new one; kept for reuse after."""
        key = (host, port)
        pooled = self._take_pooled(key)
        if pooled is not None:
            try:
                return await self._round_trip(key, *pooled, msg)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # closed by the server (idle, restarted): a new connection says what is there now
        reader, writer = await asyncio.open_connection(host, port)
        return await self._round_trip(key, reader, writer, msg)

    async def _round_trip(
        self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: Message
    ) -> Message:
        kept = False
        try:
            if self._auth is None:
                await write_frame(writer, msg)
                reply = await read_frame(reader)
                if isinstance(reply, Refused | Sealed):
                    raise PeerRefused(reply.reason if isinstance(reply, Refused) else "the peer sent a sealed reply")
            else:
                sealed = self._auth.seal_request(msg)
                await write_frame(writer, sealed)
                reply = self._auth.open_reply(sealed, await read_frame(reader))
            conns = self._pool.setdefault(key, [])
            if len(conns) < POOL_PER_ADDRESS:
                conns.append((reader, writer, time.monotonic()))
                kept = True
            return reply
        finally:  # (also on a timeout's cancellation: a connection with a request in flight is never reused)
            if not kept:
                writer.close()

    def _take_pooled(self, key: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        conns, now = self._pool.get(key, []), time.monotonic()
        while conns:
            reader, writer, used_at = conns.pop()
            if now - used_at < POOL_IDLE_S and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None
