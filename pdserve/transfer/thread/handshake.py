"""The side channel: a small TCP server and client for handshakes and liveness probes (msgpack frames).

Frames are a 4-byte big-endian length followed by one wire.py message; never pickle. One asyncio loop on
one thread ("side channel" thread) serves incoming requests and runs outgoing ones, so a slow or dead
peer never blocks the transfer thread: callers get their answer through a callback on this thread.
The listening socket is bound in the constructor (port 0 picks a free port; `port` is the bound one),
before the loop starts, so the address can be reported at once.

With a deployment secret every request and reply travels as a wire.Sealed: the client proves the secret with
an HMAC over a fresh nonce, its clock and the request; the server checks it (clock within MAX_CLOCK_SKEW_S,
each nonce once) before the handler sees anything, and answers with an HMAC over the client's nonce and the
reply, which the client checks. A request that fails gets a wire.Refused naming the check and nothing else
(no engine id, agent metadata, address or layout). Without a secret frames are plain (and a Sealed is refused).

Limits: a connection that sends no complete frame for IDLE_TIMEOUT_S is closed; past MAX_CONNECTIONS open
connections a new one is closed at once (a peer holds one connection per request, for milliseconds).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable

from pdserve.auth import MAX_CLOCK_SKEW_S, ReplayGuard, Signer, new_nonce
from pdserve.transfer.thread.netdev import advertised_address
from pdserve.transfer.wire import MAX_MESSAGE_BYTES, Message, Refused, Sealed, WireError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[Message], Awaitable[Message]]
ReplyCallback = Callable[[Message | None, str | None], None]  # (reply, error) — exactly one is None
_LEN = struct.Struct(">I")
REFUSED = "refused the connection (nothing listens there)"  # in errors: the peer process is gone
IDLE_TIMEOUT_S = 10.0  # a served connection with no complete frame for this long is closed
MAX_CONNECTIONS = 128  # served connections open at once; past it a new one is closed at once
CLIENT, SERVER = "side-channel-client", "side-channel-server"  # the Signer purposes of the two directions


class PeerRefused(Exception):
    """The other end refused our request (or its reply failed authentication); the message says why."""


def _mac_fields(nonce: str, ts_ms: int, body: bytes) -> list[object]:
    return [nonce, ts_ms, hashlib.sha256(body).hexdigest()]


class SideChannelAuth:
    """Seals and opens side-channel frames with the deployment secret (side-channel thread only)."""

    def __init__(self, secret: bytes) -> None:
        self._signer = Signer(secret)
        self._nonces = ReplayGuard()

    def seal_request(self, msg: Message) -> Sealed:
        body, nonce, ts_ms = encode(msg), new_nonce(), int(time.time() * 1000)
        return Sealed(nonce, ts_ms, self._signer.sign(CLIENT, _mac_fields(nonce, ts_ms, body)), body)

    def open_request(self, frame: Message) -> Message:
        """The request inside a client's frame; raises PeerRefused naming the failed check."""
        if not isinstance(frame, Sealed):
            raise PeerRefused("not authenticated: this side channel requires the deployment secret")
        if not self._signer.verify(CLIENT, _mac_fields(frame.nonce, frame.ts_ms, frame.body), frame.mac):
            raise PeerRefused("not authenticated: bad MAC")
        now = time.time()
        if abs(now - frame.ts_ms / 1000) > MAX_CLOCK_SKEW_S:
            raise PeerRefused(f"not authenticated: clocks differ by more than {MAX_CLOCK_SKEW_S:g} s")
        if not self._nonces.first_use(frame.nonce, frame.ts_ms / 1000 + MAX_CLOCK_SKEW_S, now):
            raise PeerRefused("not authenticated: replayed nonce")
        msg = decode(frame.body)
        if isinstance(msg, Sealed | Refused):
            raise PeerRefused("not authenticated: nested frame")
        return msg

    def seal_reply(self, request: Sealed, reply: Message) -> Sealed:
        body, ts_ms = encode(reply), int(time.time() * 1000)
        return Sealed(request.nonce, ts_ms, self._signer.sign(SERVER, _mac_fields(request.nonce, ts_ms, body)), body)

    def open_reply(self, request: Sealed, frame: Message) -> Message:
        """The reply inside the server's frame; raises PeerRefused when it is a refusal or not authentic."""
        if isinstance(frame, Refused):
            raise PeerRefused(frame.reason)
        if not isinstance(frame, Sealed) or frame.nonce != request.nonce:
            raise PeerRefused("the peer did not authenticate its reply (no deployment secret there?)")
        if not self._signer.verify(SERVER, _mac_fields(frame.nonce, frame.ts_ms, frame.body), frame.mac):
            raise PeerRefused("the peer's reply failed authentication (another deployment secret?)")
        return decode(frame.body)


async def read_frame(reader: asyncio.StreamReader) -> Message:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"frame of {n} bytes is larger than {MAX_MESSAGE_BYTES}")
    return decode(await reader.readexactly(n))


async def write_frame(writer: asyncio.StreamWriter, msg: Message) -> None:
    data = encode(msg)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


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
        self._num_connections = 0  # served connections open now (side-channel thread only)

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
        self._server = loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
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
        if self._num_connections >= MAX_CONNECTIONS:
            log.warning("side channel: %d connections open, closing a new one from %s", MAX_CONNECTIONS, peer)
            writer.close()
            return
        self._num_connections += 1
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(read_frame(reader), IDLE_TIMEOUT_S)
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection
                except TimeoutError:
                    log.info("side channel: closing a connection from %s idle for %g s", peer, IDLE_TIMEOUT_S)
                    return
                await write_frame(writer, await self._answer(frame, peer))
        except (WireError, ConnectionError) as e:
            log.warning("side channel: dropping connection from %s: %s", peer, e)
        except Exception:
            log.exception("side channel: handler failed for a request from %s", peer)
        finally:
            self._num_connections -= 1
            writer.close()

    async def _answer(self, frame: Message, peer: object) -> Message:
        """The reply to one frame: the handler's (sealed when there is a secret) or a short Refused."""
        if self._auth is None:
            if isinstance(frame, Sealed | Refused):
                return Refused("this instance has no deployment secret; the deployment disagrees on it")
            return await self._handler(frame)
        try:
            msg = self._auth.open_request(frame)
        except (PeerRefused, WireError) as e:
            log.warning("side channel: refused a request from %s: %s", peer, e)
            return Refused(str(e) if isinstance(e, PeerRefused) else "not authenticated: malformed frame")
        assert isinstance(frame, Sealed)
        return self._auth.seal_reply(frame, await self._handler(msg))

    # ---- client -------------------------------------------------------------------------------------------------
    def request(self, host: str, port: int, msg: Message, timeout_s: float, callback: ReplyCallback) -> None:
        """Send msg to host:port and call callback(reply, None) or callback(None, error) on the side-channel
        thread. Thread-safe; never blocks."""
        if self._loop is None:
            callback(None, "side channel is not running")
            return
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._ask(host, port, msg, timeout_s, callback)))  # type: ignore[union-attr]

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
        reader, writer = await asyncio.open_connection(host, port)
        try:
            if self._auth is None:
                await write_frame(writer, msg)
                reply = await read_frame(reader)
                if isinstance(reply, Refused | Sealed):
                    raise PeerRefused(reply.reason if isinstance(reply, Refused) else "the peer sent a sealed reply")
                return reply
            sealed = self._auth.seal_request(msg)
            await write_frame(writer, sealed)
            return self._auth.open_reply(sealed, await read_frame(reader))
        finally:
            writer.close()
