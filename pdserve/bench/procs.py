"""Child processes that never outlive their owner: own process group, log file, health wait, hard stop.

Each server or router runs in a session of its own (so a terminal's Ctrl-C reaches only us, and we decide
the shutdown order) and is stopped by signalling its whole process group: SIGTERM, a grace period, SIGKILL.
Descendants that left the group are found through /proc before the group is signalled and killed by pid.

Ports: a port probed free and passed to a server can be taken before the server binds it (free_ports says
by whom, and why it picks outside the kernel's ephemeral range); a server of ours started with `--port 0`
instead prints the port it bound, which wait_port() reads from its log (pdserve/http_port.py).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pdserve.http_port import bound_port


def free_ports(num: int, host: str = "127.0.0.1") -> list[int]:
    """`num` distinct TCP ports that are free right now, for servers this process starts later, outside the
    kernel's ephemeral range and never the same as one handed out before in this process.

    Why outside that range: between this probe and the server's bind (a model load later) a port in the range
    may be given by the kernel to anyone binding port 0 or connecting out (side channels, UCX listeners, the TP
    store, HTTP clients); a port outside it is taken only by someone naming it. Why random: two harnesses
    starting at once rarely pick the same one. A server of ours need not be given a port at all: `--port 0`
    prints the one the kernel picked (pdserve/http_port.py); this is for servers that cannot (vLLM) and for an
    address where nothing listens."""
    low, high = _ephemeral_range()
    candidates = [*range(max(1024, low // 2), low), *range(high + 1, 65536)] or list(range(1024, 65536))
    ports: list[int] = []
    for port in _RANDOM.sample(candidates, len(candidates)):
        if len(ports) == num:
            break
        if port not in _HANDED_OUT and _is_free(host, port):
            ports.append(port)
            _HANDED_OUT.add(port)
    if len(ports) < num:
        raise OSError(f"no {num} free ports on {host}")
    return ports


_RANDOM = random.SystemRandom()  # not the global generator: a benchmark may seed it, and two processes alike
_HANDED_OUT: set[int] = set()  # every port free_ports returned in this process: never returned twice


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port 0 and outgoing connections (Linux; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4; the name in () may contain spaces
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class ManagedProcess:
    """One child process in its own process group, writing to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name  # "prefill", "decode", "router": for messages
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self._log_start = self._log.tell()  # the log may hold earlier runs' lines (appended): this run's start here
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: signalled as a whole, shielded from our Ctrl-C
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def wait_port(self, timeout_s: float) -> int:
        """The port a pdserve server started with `--port 0` bound (it prints it before loading the model); raise
        if the process exits or the deadline passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(self._log_start)
                    port = bound_port(f.read().decode(errors="replace"))
            except OSError:
                port = None
            if port is not None:
                return port
            if not self.is_alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before it bound its port; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no port in {self.log_path} after {timeout_s:.0f} s")
            time.sleep(0.1)

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Poll `url` until it answers 200; raise if the process exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before {url} was healthy; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {url} not healthy after {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.05)  # a poll costs the server ~1 ms; a deployment waits for each of its servers in turn

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`, then any descendant that escaped it."""
        stray = descendants(self.pid)
        if self.is_alive():
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pid, signal.SIGKILL)  # the leader may be gone while its group lives on
        if self.proc.poll() is None:
            self.proc.wait(timeout=5.0)
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
