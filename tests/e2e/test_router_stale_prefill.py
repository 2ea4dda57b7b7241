"""A push router whose cached prefill coordinates went stale (issue 26, item 5).

The router signs each push transfer over P's engine id and side channel, read once from P's /kv_transfer/info.
After P restarted (a new engine id and side-channel port) and before the router's health poll saw the new
epoch, the first request got P's 403 "forged or altered": an authentication error for a stale route, and
nothing retried. Now the router refetches P's info when a call fails and retries once on new coordinates. Here
the health poll is slowed to a minute, so only the retry can save the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import Launcher, Proc, post, wait_idle

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
