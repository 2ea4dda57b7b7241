"""Child processes that never outlive their owner: own process group, log file, health wait, hard stop.

Each server or router runs in a session of its own (so a terminal's Ctrl-C reaches only us, and we decide
the shutdown order) and is stopped by signalling its whole process group: SIGTERM, a grace period, SIGKILL.
Descendants that left the group are found through /proc before the group is signalled and killed by pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path


def free_ports(num: int, host: str = "127.0.0.1") -> list[int]:
    """`num` distinct TCP ports free right now (held together while chosen, so never the same twice)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(num)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


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
            time.sleep(0.25)

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
