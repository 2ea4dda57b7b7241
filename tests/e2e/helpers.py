"""Real pdserve processes on loopback for end-to-end tests: started on ports they pick, waited for, always stopped.

    with Launcher(tmp_path) as launch:
        p = launch.serve(model_dir, "--kv-role", "prefill")
        d = launch.serve(model_dir, "--kv-role", "decode")
        launch.wait_ready()                       # every process started so far answers /health
        r = launch.proxy("pull", [p], [d])
        launch.wait_ready()
        ...                                       # leaving the block stops them all (process groups)

Each process runs in its own session (process group), so stopping it also stops anything it spawned.
`prefix` runs a process through another program, e.g. `ip netns exec NS` (tests/e2e/netns.py); `host` is then
the address it listens on, which the Launcher uses to reach it.
Logs go to files; `dump_logs()` prints them, and the Launcher does so by itself when the block raises.

Ports: `serve` and `proxy` start with `--port 0`: the process binds a port the kernel picks and prints it
(pdserve/http_port.py), and `Proc.port` reads it from the log. A port probed free here and passed on could be
taken before the process binds it, a model load later, by anything the kernel gives a port to meanwhile
(another instance's side channel or UCX listener, the TP store, an outgoing connection); CI saw that once.
A `port` given explicitly (a network namespace, a restart on the same address) is used as is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from pdserve.bench.scrape import scrape_metrics  # noqa: F401  (tests import it from here)
from pdserve.http_port import bound_port
from pdserve.transfer.faults import Faults

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_READY_TIMEOUT_S = 180.0  # model load on a busy 2-core machine, torch import included
READY_POLL_S = 0.05  # between /health polls of a process not ready yet (a poll costs the server ~1 ms)


@dataclass
class Proc:
    """One launched `python -m pdserve.cli ...` process."""

    name: str
    argv: list[str]
    given_port: int  # its --port; 0: the kernel picks, and the process prints which (port reads it)
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_statuses: tuple[int, ...] = (200,)  # /health answers that count as up
    is_ready: bool = False
    host: str = "127.0.0.1"  # the address it listens on (its --host)
    picked_port: int | None = None  # the port it printed, once read (given_port 0)

    @property
    def port(self) -> int:
        """The port it listens on; for --port 0, waits until the process printed it (before its model loads)."""
        if self.given_port:
            return self.given_port
        deadline = time.monotonic() + DEFAULT_READY_TIMEOUT_S
        while self.picked_port is None:
            self.picked_port = bound_port(self.log_text())
            if self.picked_port is None:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before it bound a port")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} printed no port in {DEFAULT_READY_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        return self.picked_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv_on_same_port(self) -> list[str]:
        """Its command line with the port it bound instead of --port 0: to start it again on the same address."""
        argv = list(self.argv)
        argv[argv.index("--port") + 1] = str(self.port)
        return argv

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def dump_log(self, out: TextIO = sys.stderr) -> None:
        print(f"\n===== {self.name} ({' '.join(self.argv)}) exit={self.popen.poll()} =====", file=out)
        print(self.log_text(), file=out)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it lingers."""
        self.terminate()
        self.wait_stopped(timeout_s)

    def terminate(self) -> None:
        """SIGTERM the process group if the process still runs (wait_stopped() finishes the stop)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        """After terminate(): wait up to timeout_s for the process to exit, then SIGKILL its group."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout_s)
        # then anything left in the group: children that outlived the leader, or a leader ignoring SIGTERM
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


class Launcher:
    """Starts pdserve processes and stops every one of them at `close()` (or at the end of a `with`)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.num_started = 0  # numbers the default names (and log files) of processes started with --port 0
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(dump_logs=exc_type is not None)

    def start(
        self,
        name: str,
        argv: list[str],
        port: int,
        ready_statuses: tuple[int, ...] = (200,),
        program: tuple[str, ...] = ("-m", "pdserve.cli"),
        prefix: tuple[str, ...] = (),
        host: str = "127.0.0.1",
    ) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(
                [*prefix, sys.executable, *program, *argv],  # `ip netns exec` execs: the pid stays the leader
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() takes everything it spawned
            )
        proc = Proc(name, argv, port, popen, log_path, ready_statuses, host=host)
        self.procs.append(proc)
        self.num_started += 1
        return proc

    def serve(
        self,
        model: str | Path,
        *args: str,
        name: str | None = None,
        faults: Faults | None = None,
        prefix: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> Proc:
        """`pdserve serve MODEL` on a port and side-channel port the kernel picks, one torch thread, a small KV
        cache (each overridable through `args`); with `faults`, through serve_with_faults.py (test-only faults).
        In another network namespace (`prefix`), pass its `host` address and a `port` (free there)."""
        port = 0 if port is None else port
        name = name or f"serve-{port or self.num_started}"
        argv = [str(model), "--host", host, "--port", str(port)]
        defaults = {"--kv-side-channel-port": "0", "--num-threads": "1", "--num-gpu-blocks": "128"}
        for flag, value in defaults.items():
            if flag not in args:
                argv += [flag, value]
        argv += list(args)
        if faults is None:
            return self.start(name, ["serve", *argv], port, prefix=prefix, host=host)
        program = (str(Path(__file__).with_name("serve_with_faults.py")), faults.to_json())
        return self.start(name, argv, port, program=program, prefix=prefix, host=host)

    def proxy(
        self,
        mode: str,
        prefill: list[Proc | str],
        decode: list[Proc | str],
        *args: str,
        name: str | None = None,
        ready_statuses: tuple[int, ...] = (200,),
        prefix: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> Proc:
        """`pdserve proxy` on a port the kernel picks, in front of `prefill` and `decode` (processes or URLs);
        in another network namespace as `serve` is."""
        port = 0 if port is None else port
        name = name or f"proxy-{port or self.num_started}"
        urls = lambda procs: [p.url if isinstance(p, Proc) else p for p in procs]  # noqa: E731
        argv = ["proxy", "--mode", mode, "--host", host, "--port", str(port)]
        argv += ["--prefill", *urls(prefill), "--decode", *urls(decode)]
        return self.start(name, argv + list(args), port, ready_statuses, prefix=prefix, host=host)

    def wait_ready(self, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Block until every started process answers /health with one of its ready statuses; raises (with
        the logs printed) if one exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            for proc in self.procs:
                while not proc.is_ready:
                    if proc.popen.poll() is not None:
                        self.dump_logs()
                        raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was ready")
                    try:
                        proc.is_ready = client.get(proc.url + "/health").status_code in proc.ready_statuses
                    except httpx.HTTPError:
                        pass
                    if not proc.is_ready:
                        if time.monotonic() > deadline:
                            self.dump_logs()
                            raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s")
                        time.sleep(READY_POLL_S)

    def dump_logs(self, out: TextIO = sys.stderr) -> None:
        for proc in self.procs:
            proc.dump_log(out)

    def close(self, dump_logs: bool = False) -> None:
        """Stop every process: SIGTERM to each in reverse start order (routers before the instances behind them),
        then wait for them together (each shuts down on its own; one at a time cost ~0.25 s per process)."""
        if dump_logs:
            self.dump_logs()
        errors = []
        for step in (Proc.terminate, Proc.wait_stopped):
            for proc in reversed(self.procs):
                try:
                    step(proc)
                except Exception as e:  # keep stopping the others
                    errors.append(f"{proc.name}: {e}")
        self.procs.clear()
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))


# --- talking to the processes -----------------------------------------------------------------------------


def wait_idle(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Poll url/metrics until no request runs or waits, every KV block is free and no push WRITE is left
    prepared; returns the last scrape (the caller asserts on it, so a timeout shows the numbers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url, headers)
        busy = m["pdserve_requests_running"] + m["pdserve_requests_waiting"] + m["pdserve_requests_waiting_for_kv"]
        busy += m["pdserve_kv_prepared_writes"]
        if (busy == 0 and m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    # verify=False: plain http to loopback, so no TLS context to build (~40 ms of CPU per call otherwise)
    return httpx.post(url + path, json=body, headers=headers, timeout=120, trust_env=False, verify=False)


def stream_events(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """POST a streaming request; the decoded `data:` payloads in order, checking that [DONE] ends them."""
    payloads: list[Any] = []
    stream = httpx.stream("POST", url + path, json=body, headers=headers, timeout=120, trust_env=False, verify=False)
    with stream as resp:  # verify=False: as post()
        assert resp.status_code == 200, resp.read().decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def joined_stream(payloads: list[dict[str, Any]]) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of a streamed completion or chat answer (return_token_ids on)."""
    text, ids, finish = "", [], None
    for p in payloads:
        assert "error" not in p, p
        for choice in p["choices"]:
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
            ids += choice.get("token_ids") or []
            finish = choice["finish_reason"] or finish
    return text, ids, finish


def wait_log_status(proc: Proc, request_id: str, timeout_s: float = 10.0) -> str | None:
    """The HTTP status in `proc`'s one log line for `request_id` ("499" = the client went away first),
    waiting for the line to appear; None if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in proc.log_text().splitlines():
            if f"request {request_id} " in line or f" client_id={request_id} " in line:
                return line.split("status=")[1].split()[0]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
