"""The real router app (build_app, its lifespan, aiohttp legs on loopback) in front of fake instances that count
the legs they get and can serve a /kv_events snapshot: which decode instance each split call lands on, and what
a kv-aware router answers for prompts it cannot hash. No pdserve processes; a few seconds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from starlette.testclient import TestClient

from pdserve.kv.block_hashes import HASH_SCHEME, prompt_block_hashes
from pdserve.kv.events_wire import KVCacheSnapshot, KVEventsAnswer, encode_answer
from pdserve.router.config import RouterConfig
from pdserve.router.proxy import build_app

VOCAB = 320
BLOCK_SIZE = 4
EPOCH = "fake-epoch"
COMPLETION = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}


class _Handler(BaseHTTPRequestHandler):
    server: FakeInstance

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/kv_events" and self.server.snapshot_keys is not None:
            self._json(200, self.server.kv_events("after=" in query))
        else:  # /health; a malformed /kv_events and /v1/models (load only) when no snapshot is served
            self._json(200, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        self._json(*self.server.answer(body))

    def log_message(self, *args: object) -> None:
        pass


class FakeInstance(ThreadingHTTPServer):
    """Answers every POST with `answer(body)` (a P without kv_transfer_params in its answer: D prefills) and
    keeps the bodies it got; serves on its own thread until close()."""

    def __init__(self, snapshot_keys: list[bytes] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []  # every POST's body, in arrival order
        self.snapshot_keys = snapshot_keys  # GET /kv_events: a snapshot of these keys (blocks of 4), then no events
        self._thread = threading.Thread(target=self.serve_forever, name="fake-instance", daemon=True)
        self._thread.start()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and max(prompt) >= VOCAB:  # what an instance answers
            return 400, {"error": {"message": "token id out of vocabulary", "type": "invalid_request_error"}}
        return 200, COMPLETION

    def kv_events(self, follows: bool) -> dict[str, Any]:
        """A snapshot to a poll without `after`, else (after a long poll's wait) no events since."""
        assert self.snapshot_keys is not None
        if not follows:
            snapshot = KVCacheSnapshot("first", BLOCK_SIZE, True, HASH_SCHEME, self.snapshot_keys)
            return encode_answer(KVEventsAnswer(EPOCH, 0, snapshot))
        time.sleep(0.2)
        return encode_answer(KVEventsAnswer(EPOCH, 0))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()

    def __enter__(self) -> FakeInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeInstance]]:
    fakes = [FakeInstance() for _ in range(3)]  # P, D0, D1
    yield fakes
    for fake in fakes:
        fake.close()


@pytest.fixture
def instances(fakes: list[FakeInstance]) -> list[FakeInstance]:
    for fake in fakes:
        fake.bodies.clear()
    return fakes


@pytest.mark.parametrize("routing", ["least-loaded", "round-robin", "kv-aware"])
@pytest.mark.parametrize("colocate_below", [None, 8])
def test_split_calls_alternate_between_two_decode_instances(
    instances: list[FakeInstance], routing: str, colocate_below: int | None
) -> None:
    """With --colocate-below, pull mode chose D once to decide whether P is needed and again after P answered,
    so each call advanced the rotation twice and every call landed on the same D (10/0)."""
    p, d0, d1 = instances
    config = RouterConfig(
        mode="pull", prefill_urls=(p.url,), decode_urls=(d0.url, d1.url), policy=routing,
        colocate_below=colocate_below, health_interval_s=60.0,
    )  # fmt: skip
    prompt = list(range(3, 43))  # 40 tokens, above the threshold: every call is split
    with TestClient(build_app(config)) as client:
        for i in range(10):
            body = {"prompt": prompt, "max_tokens": 2}
            resp = client.post("/v1/completions", json=body, headers={"X-Request-Id": f"r{i}"})
            assert resp.status_code == 200, resp.text
    assert len(p.bodies) == 10  # every call went through P
    assert (len(d0.bodies), len(d1.bodies)) == (5, 5)


def wait_for_stream(client: TestClient, url: str) -> None:
    """Until the router follows `url`'s /kv_events (its index is usable)."""
    up = f'pdserve_router_kv_stream_up{{instance="{url}"}} 1'
    deadline = time.monotonic() + 60
    while up not in client.get("/metrics").text:
        assert time.monotonic() < deadline, "the router never followed the fake instance's /kv_events"
        time.sleep(0.05)


def test_a_token_id_beyond_int64_gets_the_instance_answer_not_a_500() -> None:
    """A kv-aware router hashes token ids as int64: one beyond it raised OverflowError (a 500). Such a prompt is
    routed by load; the instance answers its 400 and the client gets that."""
    prompt = list(range(5, 13))  # two blocks of 4, cached at the instance
    with FakeInstance(prompt_block_hashes(prompt, BLOCK_SIZE)) as fake:
        config = RouterConfig(mode="colocated", instance_urls=(fake.url,), policy="kv-aware", health_interval_s=60.0)
        with TestClient(build_app(config)) as client:
            wait_for_stream(client, fake.url)
            ok = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            assert 'pdserve_router_kv_hit_blocks_total{role="instance"} 1' in client.get("/metrics").text
            for big in (2**63, 2**64 + 5):
                resp = client.post("/v1/completions", json={"prompt": [big, *prompt], "max_tokens": 2})
                assert resp.status_code == 400, resp.text
                assert "vocabulary" in resp.json()["error"]["message"]
