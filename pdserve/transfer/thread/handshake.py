"""The side channel: a small TCP server and client for handshakes and liveness probes (msgpack frames).

Frames are a 4-byte big-endian length followed by one wire.py message; never pickle. One asyncio loop on
one thread ("side channel" thread) serves incoming requests and runs outgoing ones, so a slow or dead
peer never blocks the transfer thread: callers get their answer through a callback on this thread.
The listening socket is bound in the constructor (port 0 picks a free port; `port` is the bound one),
before the loop starts, so the address can be reported at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections.abc import Awaitable, Callable

from pdserve.transfer.wire import MAX_MESSAGE_BYTES, Message, WireError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[Message], Awaitable[Message]]
ReplyCallback = Callable[[Message | None, str | None], None]  # (reply, error) — exactly one is None
_LEN = struct.Struct(">I")
REFUSED = "refused the connection (nothing listens there)"  # in errors: the peer process is gone


async def read_frame(reader: asyncio.StreamReader) -> Message:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"frame of {n} bytes is larger than {MAX_MESSAGE_BYTES}")
    return decode(await reader.readexactly(n))


async def write_frame(writer: asyncio.StreamWriter, msg: Message) -> None:
    data = encode(msg)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


def wildcard_to_reachable(host: str) -> str:
    """The address a peer should dial when we listen on a wildcard address."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class SideChannel:
    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"side channel cannot bind {host}:{port}: {e}") from None
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.host = wildcard_to_reachable(host)
        self.port: int = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None

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
        try:
            while True:
                try:
                    msg = await read_frame(reader)
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection
                await write_frame(writer, await self._handler(msg))
        except (WireError, ConnectionError) as e:
            log.warning("side channel: dropping connection from %s: %s", peer, e)
        except Exception:
            log.exception("side channel: handler failed for a request from %s", peer)
        finally:
            writer.close()

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
        else:
            callback(reply, None)

    async def _exchange(self, host: str, port: int, msg: Message) -> Message:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await write_frame(writer, msg)
            return await read_frame(reader)
        finally:
            writer.close()
