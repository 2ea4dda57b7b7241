"""The real router app (build_app, its lifespan, aiohttp legs on loopback) in front of fake instances that count
the legs they get: which decode instance each split call lands on. No pdserve processes; about a second."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from starlette.testclient import TestClient

from pdserve.router.config import RouterConfig
from pdserve.router.proxy import build_app

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
        self._json(200, {"status": "ok"})  # /health; a malformed /kv_events and /v1/models (load only)

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

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []  # every POST's body, in arrival order
        self._thread = threading.Thread(target=self.serve_forever, name="fake-instance", daemon=True)
        self._thread.start()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, COMPLETION

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()


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
