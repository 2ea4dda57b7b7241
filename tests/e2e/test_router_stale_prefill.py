"""A push router whose cached prefill coordinates went stale (issue 26, item 5).

The router signs each push transfer over P's engine id and side channel, read once from P's /kv_transfer/info.
After P restarted (a new engine id and side-channel port) and before the router's health poll saw the new
epoch, the first request got P's 403 "forged or altered": an authentication error for a stale route, and
nothing retried. Now the router refetches P's info when a call fails and retries once on new coordinates. Here
the health poll is slowed to a minute, so only the retry can save the request.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from helpers import Launcher, Proc, post, wait_idle
from stub_backend import StubBackend, error_payload

from pdserve.auth import new_secret

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 4}


def completion(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, **GREEDY}


def test_push_router_retries_once_on_a_restarted_prefill(launcher: Launcher, tiny_llama: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(new_secret() + "\n")
    secret.chmod(0o600)
    auth = ["--kv-auth-secret-file", str(secret)]
    p = launcher.serve(tiny_llama, "--kv-role", "prefill", "--kv-transfer", "push", *auth, name="P")
    d = launcher.serve(tiny_llama, "--kv-role", "decode", "--kv-transfer", "push", *auth, name="D")
    launcher.wait_ready()
    router = launcher.proxy("push", [p], [d], *auth, "--health-interval-s", "60", name="router")
    launcher.wait_ready()
    before = post(router.url, "/v1/completions", completion("the first request, on the first P"))
    assert before.status_code == 200, before.text
    old_info = post_get(p, "/kv_transfer/info")

    p.stop()  # a new process on the same HTTP port: a new engine id and side-channel port, the same URL
    p2 = launcher.start("P-restarted", p.argv_on_same_port(), p.port)
    launcher.wait_ready()
    assert post_get(p2, "/kv_transfer/info")["engine_id"] != old_info["engine_id"]
    for prompt in ("the first request after the restart", "and the next one"):
        r = post(router.url, "/v1/completions", completion(prompt))
        assert r.status_code == 200, r.text  # was: 403 "kv_capability does not match ... (forged or altered)"
        assert len(r.json()["choices"][0]["token_ids"]) == 4
    assert router.log_text().count("has new coordinates") == 1  # the first one retried; the next used them
    for proc in (p2, d):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


def post_get(proc: Proc, path: str) -> dict[str, Any]:
    import httpx

    r = httpx.get(proc.url + path, timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def push_info(engine_id: str) -> dict[str, Any]:
    return {"engine_id": engine_id, "side_channel_host": "127.0.0.1", "side_channel_port": 9, "tp_size": 1,
            "transfer_mode": "push", "kv_role": "prefill"}  # fmt: skip


def p_refuses(path: str) -> tuple[int, dict[str, Any]]:
    """P's 403 for a capability that does not match its coordinates."""
    return 403, error_payload(403, "kv_capability does not match the push coordinates (forged or altered)")


@pytest.mark.parametrize("restarting", [True, False])
def test_a_refusal_that_is_no_stale_route_is_never_a_403(launcher: Launcher, restarting: bool) -> None:
    """P refusing the router's push capability reaches the client as what it is: a P whose coordinates change
    again during the retry (restarting) is a 503 with Retry-After; one whose coordinates did not change holds
    another secret than the router, a 502 naming the prefill leg. Neither is a 403 (the client did nothing)."""
    ids = (f"p-{i}" for i in itertools.count()) if restarting else itertools.repeat("p-same")
    # P: its /kv_transfer/info names engine next(ids) on each GET, every completion is its 403; D: every
    # completion a 500 after 3 s (so P's refusal comes first)
    with (
        StubBackend(lambda: push_info(next(ids)), p_refuses) as p,
        StubBackend(lambda: push_info("unused"), lambda path: (500, error_payload(500, "decode gave up")), 3.0) as d,
    ):
        router = launcher.proxy("push", [p.url], [d.url], "--health-interval-s", "60", ready_statuses=(200, 503))
        launcher.wait_ready()
        r = post(router.url, "/v1/completions", completion("hello"))
        error = r.json()["error"]
        if restarting:
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "changed its coordinates again" in error["message"] and p.num_legs == 2
        else:
            assert r.status_code == 502 and error["type"] == "bad_gateway", r.text
            assert "refused the router's push capability" in error["message"] and p.num_legs == 1
            assert "--kv-auth-secret" in error["message"]
