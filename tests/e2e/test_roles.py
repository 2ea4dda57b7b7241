"""Credentials with roles (issue 26, item 3) and client errors answered 4xx with the right type (item 7).

One pull deployment with a secret, a client key and an internal credential on P, D and the router (the router
holds both), plus a prefill instance started as before roles existed (the secret and the client key only).
The attacks of the issue, now refused: a client holding the client key reads request ids from /timeline and
releases another user's request by id (a running decode was aborted); with only the shared key, a release by id
alone. Then the refusals a client can provoke, each a 4xx with a sanitized message and its OpenAI error type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import Launcher, Proc, post, wait_idle

from pdserve.auth import new_secret

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIENT_KEY = "client-key-0123456789"
INTERNAL_KEY = "internal-key-9876543210"
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
INTERNAL = {"Authorization": f"Bearer {INTERNAL_KEY}"}
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 4}
LEASE_S = 10.0  # P's lease: the pins of refused decode legs come back after this long
PROMPT = "Question: what is the capital of Germany? Answer: the capital of Germany is"


@dataclass
class Deployment:
    p: Proc  # pull prefill: secret, client key, internal key
    d: Proc  # pull decode: the same
    router: Proc  # both keys and the secret
    p_shared: Proc  # pull prefill as before roles: the secret and the client key only

    @property
    def keyed(self) -> list[Proc]:
        return [self.p, self.d, self.router]


@pytest.fixture(scope="module")
def dep(launcher: Launcher, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    folder = tmp_path_factory.mktemp("keys")
    (folder / "secret").write_text(new_secret() + "\n")
    (folder / "internal").write_text(INTERNAL_KEY + "\n")
    for f in folder.iterdir():
        f.chmod(0o600)
    secret = ["--kv-auth-secret-file", str(folder / "secret")]
    keys = ["--api-key", CLIENT_KEY, "--internal-api-key-file", str(folder / "internal")]

    def serve(name: str, *args: str) -> Proc:
        return launcher.serve(
            tiny_llama, "--kv-transfer", "pull", "--kv-lease-s", str(LEASE_S), *secret, *args, name=name
        )

    p = serve("P", "--kv-role", "prefill", *keys)
    d = serve("D", "--kv-role", "decode", *keys)
    p_shared = serve("P_shared", "--kv-role", "prefill", "--api-key", CLIENT_KEY)
    launcher.wait_ready()
    router = launcher.proxy("pull", [p], [d], *secret, *keys, name="router")
    launcher.wait_ready()
    return Deployment(p, d, router, p_shared)


def completion(prompt: str = PROMPT, kv: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, **GREEDY, **kw}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def prefill(proc: Proc, prompt: str = PROMPT) -> dict[str, Any]:
    """Play the router's prefill leg: P's signed answer."""
    r = post(proc.url, "/v1/completions", completion(prompt, {"do_remote_decode": True}, max_tokens=1), CLIENT)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def release(proc: Proc, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return post(proc.url, "/kv_transfer/release", body, headers)


def post_escaped(proc: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST JSON with non-ASCII escaped: a lone surrogate travels as the escape \\ud800, which JSON allows."""
    headers = {**CLIENT, "content-type": "application/json"}
    return httpx.post(proc.url + path, content=json.dumps(body), headers=headers, timeout=120, trust_env=False)


def assert_error(r: httpx.Response, status: int, kind: str, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["type"] == kind and error["code"] == status, error
    assert all(w in error["message"] for w in words), error["message"]
    for internal in ("Traceback", "TypeError", "Exception", 'File "'):
        assert internal not in error["message"], error["message"]
    return str(error["message"])


def test_the_client_key_opens_the_api_and_no_internal_route(dep: Deployment) -> None:
    for proc in dep.keyed:
        assert httpx.get(proc.url + "/v1/models", headers=CLIENT).status_code == 200, proc.name
        assert httpx.get(proc.url + "/v1/models").status_code == 401, proc.name
    for proc in (dep.p, dep.d):
        assert httpx.get(proc.url + "/metrics", headers=CLIENT).status_code == 200
        for path in ("/timeline", "/kv_transfer/info"):
            r = httpx.get(proc.url + path, headers=CLIENT)
            assert_error(r, 401, "authentication_error", "internal API key")
            assert httpx.get(proc.url + path, headers=INTERNAL).status_code == 200, (proc.name, path)
        r = release(proc, {"request_id": "req-0"}, CLIENT)
        assert_error(r, 401, "authentication_error", "internal API key")
    # the router reaches P and D with the internal key: a client with the client key is served
    r = post(dep.router.url, "/v1/completions", completion(), CLIENT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    # the client key may not open /timeline of P through anything; the router has no such route
    assert httpx.get(dep.router.url + "/timeline", headers=CLIENT).status_code in (401, 404)


def test_a_running_decode_cannot_be_released(dep: Deployment) -> None:
    """The issue's attack: a request id read from /timeline, released with POST /kv_transfer/release (a running
    decode was aborted). Now the client key opens neither route, and even the internal credential cannot abort a
    decode: only a prefill leg is a producer's to give up."""
    body = completion("hello there", max_tokens=240, stream=True)  # a whole request on D: 240 decode steps
    with httpx.stream("POST", dep.d.url + "/v1/completions", json=body, headers=CLIENT, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # running
        assert httpx.get(dep.d.url + "/timeline", headers=CLIENT).status_code == 401
        running = [e["request_id"] for e in httpx.get(dep.d.url + "/timeline", headers=INTERNAL).json()
                   if "finished" not in e["events"]]  # fmt: skip
        assert len(running) == 1, running
        assert release(dep.d, {"request_id": running[0]}, CLIENT).status_code == 401
        r = release(dep.d, {"request_id": running[0]}, INTERNAL)
        assert_error(r, 404, "not_found_error", "no pinned or running request")
        events = [line for line in lines if line.startswith("data: {")]
    assert "error" not in events[-1] and '"finish_reason":"length"' in events[-1], events[-1]
    assert len(events) >= 239  # every token streamed (the first one was read above)


def test_release_needs_the_capability_or_the_internal_key(dep: Deployment) -> None:
    # as before roles (one shared key): the key opens the route, but an id alone releases nothing
    answer = prefill(dep.p_shared)
    rid = answer["remote_request_id"]
    r = release(dep.p_shared, {"request_id": rid}, CLIENT)
    assert_error(r, 403, "permission_error", "needs its kv_capability", "id alone is not enough")
    other = prefill(dep.p_shared, "another user's prompt")  # a genuine capability, for another request
    r = release(dep.p_shared, {"request_id": rid, "kv_transfer_params": other}, CLIENT)
    assert_error(r, 403, "permission_error", "not P's answer for request_id")
    forged = {**answer, "kv_capability": {**answer["kv_capability"], "mac": "0" * 64}}
    r = release(dep.p_shared, {"request_id": rid, "kv_transfer_params": forged}, CLIENT)
    assert_error(r, 403, "permission_error", "forged or altered")
    for _ in range(2):  # with its own capability (what the router sends): released, and idempotent
        r = release(dep.p_shared, {"request_id": rid, "kv_transfer_params": answer}, CLIENT)
        assert r.status_code == 200 and r.json() == {"released": True}, r.text
    r = release(dep.p_shared, {"request_id": other["remote_request_id"], "kv_transfer_params": other}, CLIENT)
    assert r.status_code == 200, r.text
    # with an internal credential: the client key does not open the route, the internal one needs no capability
    answer = prefill(dep.p)
    assert release(dep.p, {"request_id": answer["remote_request_id"]}, CLIENT).status_code == 401
    r = release(dep.p, {"request_id": answer["remote_request_id"]}, INTERNAL)
    assert r.status_code == 200, r.text
    for proc in (dep.p, dep.p_shared):
        m = wait_idle(proc.url, headers=CLIENT)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


def test_client_errors_are_4xx_with_their_type_and_a_sanitized_message(dep: Deployment) -> None:
    """Every refusal a client can provoke here: status, OpenAI error type, a message naming the problem."""
    # a capability refused: 403 with type permission_error (was "error")
    r = post(dep.d.url, "/v1/completions", completion(kv={**prefill(dep.p), "kv_capability": None}), CLIENT)
    assert_error(r, 403, "permission_error", "unsigned")
    answer = prefill(dep.p)
    r = post(dep.d.url, "/v1/completions", completion(kv=answer), CLIENT)
    assert r.status_code == 200, r.text
    r = post(dep.d.url, "/v1/completions", completion(kv=answer), CLIENT)
    assert_error(r, 403, "permission_error", "replayed")
    # a signed prompt extended by extra tokens: 400 at the edge (was a 500 from D's transfer thread)
    answer = prefill(dep.p)
    r = post(dep.d.url, "/v1/completions", completion(PROMPT + " and more", kv=answer), CLIENT)
    n = answer["remote_num_tokens"]
    assert_error(r, 400, "invalid_request_error", f"name KV for {n} tokens", "send the prompt the prefill")
    # a lone surrogate: 400 naming it, not the tokenizer's TypeError; on an instance and through the router
    for proc in (dep.d, dep.router):
        r = post_escaped(proc, "/v1/completions", completion("abc\ud800"))
        assert_error(r, 400, "invalid_request_error", "not valid Unicode: lone surrogate '\\ud800' at character 3")
        chat = {"messages": [{"role": "user", "content": "\udc00"}], "max_tokens": 2}
        r = post_escaped(proc, "/v1/chat/completions", chat)
        assert_error(r, 400, "invalid_request_error", "messages[0].content is not valid Unicode")
    # an absurd prompt: refused by its length in characters, before the tokenizer sees it
    r = post(dep.p.url, "/v1/completions", completion("x" * 4_000_000), CLIENT)
    assert_error(r, 400, "invalid_request_error", "has 4000000 characters, more than any prompt under max_model_len")
    r = post(dep.router.url, "/v1/completions", completion("x" * 4_000_000), CLIENT)
    assert_error(r, 400, "invalid_request_error", "has 4000000 characters")
    # and what was refused before still is, with its type
    assert_error(post(dep.d.url, "/v1/completions", completion(max_tokens=0), CLIENT), 400, "invalid_request_error")
    assert_error(post(dep.d.url, "/v1/completions", completion(model="nope"), CLIENT), 404, "not_found_error")
    assert_error(post(dep.d.url, "/v1/completions", completion()), 401, "authentication_error")
    for proc in (dep.p, dep.d):
        m = wait_idle(proc.url, timeout_s=LEASE_S + 30, headers=CLIENT)  # P's pins of the refused legs: the lease
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name
