"""1P1D behind `pdserve proxy` (pull and push, P and D with different block sizes) against a colocated
`--kv-role both` server: greedy answers identical for concurrent requests, streamed or not, completions and
chat; blocks back to total everywhere; KV bytes counted; the openai client; disconnects; one request id."""

from __future__ import annotations

import json
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import (
    REPO_ROOT,
    Launcher,
    Proc,
    joined_stream,
    post,
    scrape_metrics,
    stream_events,
    wait_idle,
    wait_log_status,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_BLOCKS = 64
# prompts of 1 to ~7 blocks of 16 tokens (byte-level tokenizer: about one token per character)
PROMPTS = ["Hi", "The capital of France is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "z" * 110]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "What is a cat? " * 5}],
]
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 10}


@dataclass
class Deployment:
    mode: str
    prefill: Proc
    decode: Proc
    router: Proc


@pytest.fixture(scope="module")
def reference(launcher: Launcher, tiny_llama: Path) -> Proc:
    proc = launcher.serve(tiny_llama, "--kv-role", "both", "--num-gpu-blocks", str(NUM_BLOCKS), name="reference")
    launcher.wait_ready()
    return proc


@pytest.fixture(
    scope="module",
    params=[("pull", 16, 32), ("pull", 32, 16), ("push", 16, 32), ("push", 32, 16)],
    ids=lambda p: f"{p[0]}-P{p[1]}-D{p[2]}",
)
def pd(request: pytest.FixtureRequest, launcher: Launcher, tiny_llama: Path, reference: Proc) -> Any:
    mode, p_block, d_block = request.param
    if mode == "push" and not (REPO_ROOT / "pdserve/transfer/thread/push.py").exists():
        pytest.skip("push-mode transfer is not in this tree yet")
    common = ["--kv-transfer", mode, "--num-gpu-blocks", str(NUM_BLOCKS)]
    tag = f"{mode}-P{p_block}-D{d_block}"
    p = launcher.serve(tiny_llama, "--kv-role", "prefill", "--block-size", str(p_block), *common, name=f"P-{tag}")
    d = launcher.serve(tiny_llama, "--kv-role", "decode", "--block-size", str(d_block), *common, name=f"D-{tag}")
    launcher.wait_ready()
    router = launcher.proxy(mode, [p], [d], name=f"router-{tag}")
    launcher.wait_ready()
    yield Deployment(mode, p, d, router)
    for proc in (router, d, p):  # free the cores for the next deployment
        proc.stop()


def _both(reference: Proc, router: Proc, path: str, bodies: list[dict[str, Any]], stream: bool) -> tuple[list, list]:
    """The answers of the reference and of the router to `bodies`, each batch sent concurrently, as
    (text, token ids, finish reason) triples."""

    def ask(url: str, body: dict[str, Any]) -> tuple[str, list[int], str | None]:
        if stream:
            return joined_stream(stream_events(url, path, {**body, "stream": True}))
        resp = post(url, path, body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, choice["token_ids"], choice["finish_reason"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        expected = list(pool.map(lambda b: ask(reference.url, b), bodies))
        got = list(pool.map(lambda b: ask(router.url, b), bodies))
    return expected, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_colocated(reference: Proc, pd: Deployment, stream: bool) -> None:
    bodies = [{"prompt": p, **GREEDY} for p in PROMPTS]
    expected, got = _both(reference, pd.router, "/v1/completions", bodies, stream)
    assert all(len(ids) == GREEDY["max_tokens"] for _, ids, _ in got)
    assert got == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equal_colocated(reference: Proc, pd: Deployment, stream: bool) -> None:
    bodies = [{"messages": m, **GREEDY} for m in CHATS]
    expected, got = _both(reference, pd.router, "/v1/chat/completions", bodies, stream)
    assert got == expected


def test_openai_client_through_router(reference: Proc, pd: Deployment) -> None:
    import openai

    def answers(url: str) -> list[str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        kw: dict[str, Any] = dict(model="llama", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        out = [client.completions.create(prompt=PROMPTS[1], **kw).choices[0].text]
        chunks = client.completions.create(prompt=PROMPTS[1], stream=True, **kw)
        out.append("".join(c.choices[0].text for c in chunks if c.choices))
        out.append(client.chat.completions.create(messages=CHATS[1], **kw).choices[0].message.content or "")
        chunks = client.chat.completions.create(messages=CHATS[1], stream=True, **kw)
        out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert [m.id for m in client.models.list()] == ["llama"]
        return out

    got = answers(pd.router.url)
    assert got[0] == got[1] and got[2] == got[3]
    assert got == answers(reference.url)


def test_one_request_id_on_both_legs(pd: Deployment) -> None:
    request_id = f"rid-{uuid.uuid4().hex}"
    resp = post(pd.router.url, "/v1/completions", {"prompt": PROMPTS[2], **GREEDY}, {"X-Request-Id": request_id})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == request_id
    instance_events = ["http_received", "body_read", "body_parsed", "body_validated", "prompt_ready", "admitted"]
    for proc in (pd.prefill, pd.decode):
        timeline = httpx.get(proc.url + "/timeline").json()
        (entry,) = [t for t in timeline if t["client_request_id"] == request_id]
        events = entry["events"]  # the HTTP edge's (http_timeline.py) before the engine's, in order
        times = [events[e] for e in [*instance_events, "arrival", "first_token"]]
        assert times == sorted(times), (proc.name, events)
    (p_entry,) = [t for t in httpx.get(pd.prefill.url + "/timeline").json() if t["client_request_id"] == request_id]
    assert p_entry["events"]["first_token"] <= p_entry["events"]["answer_encoded"]  # P's answer, after its token
    (routed,) = [t for t in httpx.get(pd.router.url + "/timeline").json() if t["request_id"] == request_id]
    order = ["http_received", "body_read", "body_parsed", "body_validated", "prefill_sent", "prefill_answered"]
    order += ["prefill_read", "decode_sent", "decode_answered"]
    if pd.mode == "push":  # both legs leave at once
        order = order[:4] + ["decode_answered"]
    times = [routed["events"][e] for e in order]
    assert times == sorted(times), routed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_disconnect_frees_both_sides(pd: Deployment, stream: bool) -> None:
    request_id = f"gone-{uuid.uuid4().hex}"
    body = {"prompt": PROMPTS[2], "max_tokens": 150, "ignore_eos": True, "stream": stream}
    if stream:
        headers = {"X-Request-Id": request_id}
        with httpx.stream("POST", pd.router.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
    else:
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", pd.router.port)) as s:
            s.sendall(head.encode() + payload)
            assert wait_log_status(pd.prefill, request_id) == "200"  # the prefill leg is done: D is decoding
    assert wait_log_status(pd.decode, request_id) == "499"  # D noticed and aborted, rather than finishing
    for proc in (pd.prefill, pd.decode):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


def test_blocks_back_and_bytes_counted(reference: Proc, pd: Deployment) -> None:
    """Runs after the others of this deployment (file order): everything is free, and KV really moved."""
    for proc in (reference, pd.prefill, pd.decode):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == NUM_BLOCKS, proc.name
    d, p = scrape_metrics(pd.decode.url), scrape_metrics(pd.prefill.url)
    assert d["pdserve_kv_received_bytes_total"] > 0
    assert d['pdserve_kv_transfers_total{result="failed"}'] == 0
    if pd.mode == "push":
        assert p["pdserve_kv_sent_bytes_total"] > 0
