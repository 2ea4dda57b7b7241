"""`pdserve proxy --mode colocated` over two `--kv-role both` instances, and selective disaggregation
(`--colocate-below`) in a pull router: greedy answers equal a single instance's, both instances get traffic, a
dead instance is a 502 naming it, a disconnect aborts upstream, short prompts never reach P."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import Launcher, Proc, joined_stream, post, stream_events, wait_idle, wait_log_status

from pdserve.bench.procs import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["Hi", "The capital of France is", "z" * 110]
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 6}


def _colocated_router(launcher: Launcher, urls: list[str], *args: str) -> Proc:
    argv = ["proxy", "--mode", "colocated", "--port", "0", "--instance", *urls, "--connect-timeout-s", "2"]
    name = f"router-colocated-{launcher.num_started}"
    router = launcher.start(name, argv + list(args), 0, ready_statuses=(200, 503))
    launcher.wait_ready()
    return router


def _answer(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, list[int]]:
    if body.get("stream"):
        text, ids, _ = joined_stream(stream_events(url, "/v1/completions", body, headers))
        return text, ids
    resp = post(url, "/v1/completions", body, headers)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"], choice["token_ids"]


def _timeline_ids(proc: Proc) -> set[str]:
    return {t["client_request_id"] for t in httpx.get(proc.url + "/timeline", timeout=10).json()}


@pytest.fixture(scope="module")
def instances(launcher: Launcher, tiny_llama: Path) -> list[Proc]:
    procs = [launcher.serve(tiny_llama, "--kv-role", "both", name=f"both-{i}") for i in range(2)]
    launcher.wait_ready()
    return procs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_colocated_equals_one_instance_and_spreads(launcher: Launcher, instances: list[Proc], stream: bool) -> None:
    router = _colocated_router(launcher, [p.url for p in instances], "--policy", "round-robin")
    assert httpx.get(router.url + "/health").json()["instances"] == [p.url for p in instances]
    before = [_timeline_ids(p) for p in instances]
    request_ids = [f"coloc-{uuid.uuid4().hex}" for _ in PROMPTS]
    for prompt, rid in zip(PROMPTS, request_ids, strict=True):
        body = {"prompt": prompt, **GREEDY, "stream": stream}
        expected = _answer(instances[0].url, body)
        assert _answer(router.url, body, {"X-Request-Id": rid}) == expected
    seen = [_timeline_ids(p) - b for p, b in zip(instances, before, strict=True)]
    assert all(any(rid in s for rid in request_ids) for s in seen), "round robin must use both instances"
    assert "route=whole" in router.log_text() and "whole_total=3" in router.log_text()


def test_colocated_routes_around_a_dead_instance(launcher: Launcher, instances: list[Proc]) -> None:
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    router = _colocated_router(launcher, [instances[0].url, dead], "--policy", "round-robin")
    assert httpx.get(router.url + "/health").status_code == 503  # /health names every backend's state
    statuses = [
        post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream}).status_code
        for stream in (False, True)
        for _ in range(2)  # round robin would send one of each pair to the dead instance
    ]
    assert statuses == [200, 200, 200, 200]  # the health monitor marked it down: every request went around it
    only_dead = _colocated_router(launcher, [dead])
    resp = post(only_dead.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert "instance" in message and dead in message, message


def test_colocated_disconnect_aborts_the_instance(launcher: Launcher, instances: list[Proc]) -> None:
    router = _colocated_router(launcher, [instances[1].url])
    request_id = f"gone-{uuid.uuid4().hex}"
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    assert wait_log_status(instances[1], request_id) == "499"
    m = wait_idle(instances[1].url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_short_prompts_skip_prefill(launcher: Launcher, tiny_llama: Path, instances: list[Proc], mode: str) -> None:
    p = launcher.serve(tiny_llama, "--kv-role", "prefill", "--kv-transfer", mode, name=f"P-{mode}")
    d = launcher.serve(tiny_llama, "--kv-role", "decode", "--kv-transfer", mode, name=f"D-{mode}")
    launcher.wait_ready()
    router = launcher.proxy(mode, [p], [d], "--colocate-below", "8", name=f"router-selective-{mode}")
    launcher.wait_ready()
    short, long = f"short-{uuid.uuid4().hex}", f"long-{uuid.uuid4().hex}"
    for prompt, rid in ((PROMPTS[0], short), (PROMPTS[2], long)):  # ~1 and ~28 estimated tokens
        for stream in (False, True):
            body = {"prompt": prompt, **GREEDY, "stream": stream}
            assert _answer(router.url, body, {"X-Request-Id": rid}) == _answer(instances[0].url, body)
    assert short not in _timeline_ids(p) and short in _timeline_ids(d)
    assert long in _timeline_ids(p) and long in _timeline_ids(d)
    log = router.log_text()
    assert f"request {short} mode={mode} route=whole prefill=None" in log
    assert f"request {long} mode={mode} route=split" in log
    assert "whole_total=2" in log
    for proc in (router, d, p):  # free the cores for the next deployment
        proc.stop()
