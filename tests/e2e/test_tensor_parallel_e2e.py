"""`pdserve serve --tensor-parallel-size 2 --kv-role both` as a real process: the same completion as TP 1,
every rank process joined at shutdown, and a killed rank failing the next request at once (no hang) and
turning /health unhealthy."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import Launcher, Proc, post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _rank_pids(server: Proc) -> list[int]:
    """Pids of the server's spawned rank processes (multiprocessing spawn children)."""
    children = psutil.Process(server.popen.pid).children()
    return [c.pid for c in children if "spawn_main" in " ".join(c.cmdline())]


def _completion(server: Proc) -> dict:
    r = post(server.url, "/v1/completions", BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_tp2_server_equals_tp1_and_joins_its_ranks(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    tp1 = fresh_launcher.serve(tiny_llama)
    tp2 = fresh_launcher.serve(tiny_llama, "--tensor-parallel-size", "2", "--kv-role", "both")
    fresh_launcher.wait_ready()
    assert _completion(tp2) == _completion(tp1)
    ranks = _rank_pids(tp2)
    assert len(ranks) == 1
    children = [c.pid for c in psutil.Process(tp2.popen.pid).children(recursive=True)]
    os.kill(tp2.popen.pid, signal.SIGTERM)  # the server alone, not its process group: it must stop its ranks
    assert tp2.popen.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    assert "Application shutdown complete" in tp2.log_text()
    deadline = time.monotonic() + 5  # the resource tracker leaves when its pipe closes
    while any(psutil.pid_exists(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left after shutdown: {left}"


def test_killed_rank_fails_the_next_request_and_health(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    server = fresh_launcher.serve(tiny_llama, "--tensor-parallel-size", "2")
    fresh_launcher.wait_ready()
    _completion(server)
    (rank,) = _rank_pids(server)
    os.kill(rank, signal.SIGKILL)
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30, trust_env=False)
    assert time.monotonic() - started < 10
    assert r.status_code >= 500 and "tensor-parallel rank 1" in r.text, r.text
    health = httpx.get(server.url + "/health", timeout=5, trust_env=False)
    assert health.status_code == 503 and "tensor-parallel rank 1" in health.text, health.text
    server.popen.send_signal(signal.SIGTERM)
    try:
        server.popen.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not stop after its rank died")
