"""`pdserve serve --port 0` and `pdserve proxy --port 0`: the kernel picks the HTTP port and the server says which.

Why: a harness that starts several servers at once used to probe for a free port (bind, read, close) and pass
it on. Between that probe and the server's own bind (a torch import and a model load later) the kernel may
hand the same port to anyone asking for port 0 — another server's side channel, UCX's listener, the TP store,
an outgoing connection — and the server then fails with EADDRINUSE (CI saw this once, for the TP store). With
`--port 0` the server binds a port the kernel picks before anything else starts, so nobody else can hold it,
and prints PORT_LINE on stderr, once, whatever the log level; bound_port() reads it back from the server's log
(tests/e2e/helpers.py, pdserve/bench/procs.py).

A fixed `--port` is left to uvicorn, exactly as before (it binds after the app started; every address a host
name resolves to).
"""

from __future__ import annotations

import re
import socket
import sys

STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start (a port taken, the app failed)
PORT_LINE = "pdserve {command}: listening on http://{host}:{port}"  # printed only for --port 0
_PORT_LINE_RE = re.compile(r"^pdserve \w+: listening on http://\S+:(\d+)$", re.MULTILINE)


def bind_port_zero(command: str, host: str, port: int) -> list[socket.socket] | None:
    """For `--port 0`: a socket bound to a port the kernel picked, for uvicorn.Server.run(sockets=...), after
    printing PORT_LINE (command: "serve" or "proxy"); None for any other port (uvicorn binds it). Raises OSError.

    Bound as uvicorn binds (SO_REUSEADDR; IPv6 when host has a ':'); not inherited by child processes
    (tensor-parallel ranks): only this process serves HTTP on it. Not listening until uvicorn starts: a client
    meanwhile gets "connection refused", as before the bind."""
    if port != 0:
        return None
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP (they take
    # the listener's), and without it an answer written in two parts waits for the client's delayed ACK (~40 ms)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    shown = f"[{host}]" if ":" in host else host
    print(PORT_LINE.format(command=command, host=shown, port=sock.getsockname()[1]), file=sys.stderr, flush=True)
    return [sock]


def bound_port(log_text: str) -> int | None:
    """The port a server started with `--port 0` printed in its log (PORT_LINE); None until it has."""
    m = _PORT_LINE_RE.search(log_text)
    return None if m is None else int(m.group(1))
