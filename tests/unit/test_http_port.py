"""`--port 0`'s socket (http_port.bind_port_zero): connections accepted on it get TCP_NODELAY from asyncio.

Without it (the socket made with proto 0, which asyncio does not recognise as TCP) every answer the server wrote
in two parts (head, then body; each streamed chunk) waited for the client's delayed ACK: a 400 took ~48 ms instead
of ~6 ms on loopback, and every leg through the router and every benchmark against a `--port 0` deployment paid it.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.http_port import PORT_LINE, bind_port_zero, bound_port


async def _nodelay_of_accepted(listener: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection accepted by an asyncio server on `listener`."""
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=listener)
    async with server:
        host, port = listener.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nodelay(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        sockets = bind_port_zero("serve", host, 0)
    except OSError:
        pytest.skip(f"no {host} on this machine")
    assert sockets is not None and len(sockets) == 1
    port = sockets[0].getsockname()[1]
    assert bound_port(capsys.readouterr().err) == port
    assert asyncio.run(_nodelay_of_accepted(sockets[0])) != 0


def test_a_given_port_is_left_to_uvicorn(capsys: pytest.CaptureFixture[str]) -> None:
    assert bind_port_zero("proxy", "127.0.0.1", 8123) is None
    assert capsys.readouterr().err == ""
    assert bound_port(PORT_LINE.format(command="proxy", host="127.0.0.1", port=8123)) == 8123
