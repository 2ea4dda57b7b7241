"""The router's health checks: it routes around a dead decode instance and takes it back, refuses a pull
request before the prefill leg when no decode instance is healthy, releases P's pin at once when the decode
leg fails, and survives a prefill instance restarted on the same address (new epoch: cached info dropped)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, post, scrape_metrics, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 6, "temperature": 0}
INTERVAL = "0.2"  # the routers' health-check interval (s)


def kill(proc: Proc) -> None:
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)


def restart(launcher: Launcher, proc: Proc) -> Proc:
    """The same command line (same ports) again; waits until it is healthy."""
    again = launcher.start(proc.name + "-again", proc.argv_on_same_port(), proc.port)
    launcher.wait_ready()
    return again


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def router_will_say(router: Proc, what: str) -> Callable[[], None]:
    """A wait until the router's health monitor says `what` once more than it has so far (router/health.py logs
    each change of a backend's mark: unhealthy, healthy again, restarted; the marks are not in its /metrics, and
    its /health checks the backends live rather than reading them). Taken before the change it waits for: a
    backend not ready yet at the start is marked unhealthy too."""
    before = router.log_text().count(what)

    def wait() -> None:
        assert wait_for(lambda: router.log_text().count(what) > before), f"the router never said {what!r}"

    return wait


def wait_router_marks_healthy(router: Proc, procs: list[Proc]) -> None:
    """Wait until the router's health monitor marks every one of `procs` healthy: one started after the router
    was marked unhealthy at its first check and is marked healthy again only at a later one, maybe after
    wait_ready() returned. Until then a kill changes no mark, and router_will_say("... is unhealthy") would wait
    for a message that never comes."""
    for proc in procs:

        def healthy(url: str = proc.url) -> bool:
            text = router.log_text()
            return text.count(f"{url} is healthy again") >= text.count(f"{url} is unhealthy")

        assert wait_for(healthy), f"the router never marked {proc.name} healthy"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_dead_decode_is_routed_around_and_taken_back(fresh_launcher: Launcher, tiny_llama: Path, mode: str) -> None:
    flags = ("--kv-transfer", mode)
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", *flags, name="p")
    d1 = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", *flags, name="d1")
    d2 = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", *flags, name="d2")
    router = fresh_launcher.proxy(
        mode, [p], [d1, d2], "--health-interval-s", INTERVAL, ready_statuses=(200, 503), name="router"
    )
    fresh_launcher.wait_ready()
    wait_router_marks_healthy(router, [p, d1, d2])
    expected = post(router.url, "/v1/completions", BODY).json()["choices"][0]["text"]
    unhealthy = router_will_say(router, f"decode instance {d2.url} is unhealthy")
    kill(d2)
    unhealthy()  # routed around from now on
    for _ in range(6):  # every request lands on d1: none fails
        resp = post(router.url, "/v1/completions", BODY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected
    healthy = router_will_say(router, f"decode instance {d2.url} is healthy again")
    d2 = restart(fresh_launcher, d2)
    healthy()
    before = scrape_metrics(d2.url)["pdserve_engine_steps_total"]
    for _ in range(6):
        assert post(router.url, "/v1/completions", BODY).status_code == 200
    assert scrape_metrics(d2.url)["pdserve_engine_steps_total"] > before  # taken back
    for proc in (p, d1, d2):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


def test_pull_without_healthy_decode_is_refused_before_prefill(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", "--kv-transfer", "pull", name="p")
    d = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", "--kv-transfer", "pull", name="d")
    router = fresh_launcher.proxy("pull", [p], [d], "--health-interval-s", INTERVAL, ready_statuses=(200, 503))
    fresh_launcher.wait_ready()
    wait_router_marks_healthy(router, [p, d])
    unhealthy = router_will_say(router, f"decode instance {d.url} is unhealthy")
    kill(d)
    unhealthy()
    resp = post(router.url, "/v1/completions", BODY)
    assert resp.status_code == 503, resp.text
    assert "no healthy decode instance" in resp.json()["error"]["message"]
    assert httpx.get(p.url + "/timeline").json() == []  # P never ran the prefill


def test_failed_decode_leg_releases_the_prefill_pin_at_once(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    """D refuses the leg (its max_model_len is smaller than P's): P's pinned blocks are freed well before the
    30 s lease, because the router tells P."""
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", "--kv-transfer", "pull", name="p")
    d = fresh_launcher.serve(
        tiny_llama, "--kv-role", "decode", "--kv-transfer", "pull", "--max-model-len", "32", name="d"
    )
    router = fresh_launcher.proxy("pull", [p], [d], ready_statuses=(200, 503))
    fresh_launcher.wait_ready()
    long_body = {**BODY, "prompt": "x" * 60}  # fits P (256) but not D (32)
    started = time.monotonic()
    resp = post(router.url, "/v1/completions", long_body)
    assert resp.status_code == 400, resp.text  # D's own refusal, passed through
    m = wait_idle(p.url, timeout_s=10)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]
    assert time.monotonic() - started < 10  # not the lease


def test_restarted_prefill_costs_the_next_request_nothing(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", "--kv-transfer", "push", name="p")
    d = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", "--kv-transfer", "push", name="d")
    router = fresh_launcher.proxy("push", [p], [d], "--health-interval-s", INTERVAL, ready_statuses=(200, 503))
    fresh_launcher.wait_ready()
    wait_router_marks_healthy(router, [p, d])
    expected = post(router.url, "/v1/completions", BODY).json()["choices"][0]["text"]
    restarted = router_will_say(router, f"prefill instance {p.url} restarted (epoch")
    kill(p)
    p = restart(fresh_launcher, p)  # same HTTP port, a new engine id and side channel
    assert wait_for(lambda: httpx.get(router.url + "/health").status_code == 200)
    restarted()  # the router noticed the new epoch and dropped what it cached about P
    resp = post(router.url, "/v1/completions", BODY)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == expected
    for proc in (p, d):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name
