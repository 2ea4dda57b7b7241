"""The HTTP edge of an instance and of the router: API keys, body-size limits, hostile headers and bodies.
Real processes on loopback (a colocated instance with a key, a pull router in front of it with the same key)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from helpers import Launcher, Proc, post, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL_BODY_MB = "0.05"  # 52 KB: small enough to test without sending megabytes


@pytest.fixture(scope="module")
def keyed(launcher: Launcher, tiny_llama: Path) -> tuple[Proc, Proc]:
    """(instance, router): both need KEY; the instance also refuses bodies over SMALL_BODY_MB."""
    inst = launcher.serve(
        tiny_llama, "--kv-role", "both", "--api-key", KEY, "--max-body-mb", SMALL_BODY_MB, name="keyed"
    )
    router = launcher.proxy("pull", [inst.url], [inst.url], "--api-key", KEY, ready_statuses=(200,))
    launcher.wait_ready()
    return inst, router


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/timeline", "/kv_transfer/info"])
def test_instance_routes_need_the_key(keyed: tuple[Proc, Proc], path: str) -> None:
    inst, _ = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.get(inst.url + path, headers=headers)
        assert resp.status_code == 401, (path, headers, resp.text)
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(inst.url + path, headers=AUTH).status_code in (200, 503)  # 503: no transfer info on "both"
    assert httpx.get(inst.url + "/health").status_code == 200  # open: orchestrators poll it


def test_router_needs_the_key_and_forwards_its_own(keyed: tuple[Proc, Proc]) -> None:
    _, router = keyed
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    assert post(router.url, "/v1/completions", body).status_code == 401
    resp = post(router.url, "/v1/completions", body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_body_over_the_limit_is_413_and_the_instance_keeps_serving(keyed: tuple[Proc, Proc]) -> None:
    inst, _ = keyed
    big = {"prompt": "x" * 100_000, "max_tokens": 1}
    resp = post(inst.url, "/v1/completions", big, headers=AUTH)
    assert resp.status_code == 413, resp.text
    chunked = httpx.post(  # no Content-Length: the limit is counted while the body streams in
        inst.url + "/v1/completions",
        content=iter([b'{"prompt": "', b"x" * 60_000, b'", "max_tokens": 1}']),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert chunked.status_code == 413, chunked.text
    ok = post(inst.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200


def test_hostile_request_ids_and_deep_json(keyed: tuple[Proc, Proc]) -> None:
    inst, router = keyed
    body = {"prompt": "hi", "max_tokens": 2}
    long_id = "r" * 60_000  # under web.MAX_REQUEST_HEAD_BYTES: taken whatever the reads split it into
    for url in (inst.url, router.url):
        resp = post(url, "/v1/completions", body, headers={**AUTH, "X-Request-Id": long_id})
        assert resp.status_code == 200, (url, resp.text[:300])
        assert len(resp.headers["X-Request-Id"]) <= 128
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp = httpx.post(
        router.url + "/v1/completions", content=deep, headers={**AUTH, "content-type": "application/json"}
    )
    assert resp.status_code in (400, 413), resp.text[:300]
    # a retry that reuses a request id while the first is in flight is a new request, not a collision
    same = {**AUTH, "X-Request-Id": "retry-1"}
    a = post(inst.url, "/v1/completions", body, headers=same)
    b = post(inst.url, "/v1/completions", body, headers=same)
    assert a.status_code == b.status_code == 200 and a.json()["id"] != b.json()["id"]
    m = wait_idle(inst.url, headers=AUTH)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]


def test_long_head_arriving_in_pieces_is_taken(keyed: tuple[Proc, Proc]) -> None:
    """A 60 KB request head that arrives over several reads is served like one that arrives at once (uvicorn's
    default 16 KiB limit on an incomplete head answered it 400 and reset the connection, depending on timing)."""
    for proc in keyed:
        parts = urlsplit(proc.url)
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"X-Request-Id: {'p' * 60_000}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
            for i in range(0, len(head), 8192):
                sock.sendall(head[i : i + 8192])
                time.sleep(0.02)  # each piece its own read on the server
            sock.sendall(body)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), (proc.name, reply[:300])


LONG_STREAM = {"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}  # >= 240 engine steps


def test_full_instance_answers_503_with_retry_after(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    inst = fresh_launcher.serve(tiny_llama, "--kv-role", "both", "--max-inflight-requests", "1")
    fresh_launcher.wait_ready()
    with httpx.stream("POST", inst.url + "/v1/completions", json=LONG_STREAM, timeout=60) as first:
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # in flight until its stream is closed
        refused = post(inst.url, "/v1/completions", {"prompt": "w", "max_tokens": 2})
    assert refused.status_code == 503 and "in flight" in refused.text, refused.text
    assert refused.headers["Retry-After"] == "1"
    m = wait_idle(inst.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]
    assert post(inst.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_queue_wait_deadline_answers_503(fresh_launcher: Launcher, tiny_llama: Path) -> None:
    """One sequence runs at a time: a request still queued behind a long stream after 50 ms is refused."""
    inst = fresh_launcher.serve(tiny_llama, "--kv-role", "both", "--max-num-seqs", "1", "--max-queue-wait-s", "0.05")
    fresh_launcher.wait_ready()
    waited = None
    for _ in range(5):  # on a loaded machine the first stream itself may miss the 50 ms deadline: try again
        with httpx.stream("POST", inst.url + "/v1/completions", json=LONG_STREAM, timeout=60) as first:
            lines = first.iter_lines()
            if first.status_code == 503:
                continue
            assert next(lines).startswith("data: ")  # running, and holding the only sequence slot
            waited = post(inst.url, "/v1/completions", {"prompt": "y", "max_tokens": 2})
            assert sum(1 for line in lines if line.startswith("data: {")) > 0  # the first stream is unharmed
            break
    assert waited is not None, "the first stream never started within its deadline"
    assert waited.status_code == 503, waited.text
    assert waited.headers["Retry-After"] == "1"
    assert "request still queued after 0.05 s" in waited.json()["error"]["message"]
    m = wait_idle(inst.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]
