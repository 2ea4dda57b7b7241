"""The router when a backend is down or refuses: a 502 naming the leg and its URL, 503 health, 4xx passed on."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, post, wait_idle
from stub_backend import StubBackend, error_payload

from pdserve.bench.procs import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def backend(launcher: Launcher, tiny_llama: Path) -> Proc:
    """A colocated instance; as a P leg it answers without kv_transfer_params, as a D leg it prefills."""
    proc = launcher.serve(tiny_llama, "--kv-role", "both", name="backend")
    launcher.wait_ready()
    return proc


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there


def _router(launcher: Launcher, mode: str, prefill: str, decode: str) -> Proc:
    router = launcher.proxy(mode, [prefill], [decode], "--connect-timeout-s", "2", ready_statuses=(200, 503))
    launcher.wait_ready()
    return router


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_down_is_502_naming_prefill(
    launcher: Launcher, backend: Proc, dead_url: str, mode: str, stream: bool
) -> None:
    router = _router(launcher, mode, dead_url, backend.url)
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert "prefill" in message and dead_url in message, message
    assert httpx.get(router.url + "/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_decode_down_is_503_naming_decode_before_prefill(
    launcher: Launcher, backend: Proc, dead_url: str, stream: bool
) -> None:
    """The pull router checks D's health before the prefill leg: no prefill is spent on a request D cannot take."""
    router = _router(launcher, "pull", backend.url, dead_url)
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    message = resp.json()["error"]["message"]
    assert "decode" in message and dead_url in message, message


def test_push_router_refuses_a_pull_prefill(launcher: Launcher, backend: Proc) -> None:
    router = _router(launcher, "push", backend.url, backend.url)
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 502
    assert "push" in resp.json()["error"]["message"]


def test_backend_4xx_passes_through(launcher: Launcher, backend: Proc) -> None:
    router = _router(launcher, "pull", backend.url, backend.url)
    assert httpx.get(router.url + "/health").status_code == 200
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "temperature": -1})
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]["message"]
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "model": "nope"})
    assert resp.status_code == 404
    resp = httpx.post(router.url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "llama"


@pytest.fixture
def stub_prefill() -> Iterator[StubBackend]:
    """A push-mode prefill that advertises a side channel which accepts connections and never answers, and fails
    every completion after 1.5 s with a 500: the router must cancel the decode leg and say so. A new stub per
    test: a new side-channel address, so D's handshake with it starts afresh (and takes longer than 1.5 s to
    fail)."""
    with socket.create_server(("127.0.0.1", 0)) as side_channel:  # accepts (backlog), never answers
        info = {"engine_id": "stub-prefill", "side_channel_host": "127.0.0.1",
                "side_channel_port": side_channel.getsockname()[1], "tp_size": 1, "block_size": 16,
                "transfer_mode": "push", "kv_role": "prefill"}  # fmt: skip
        with StubBackend(lambda: info, lambda path: (500, error_payload(500, "prefill exploded")), 1.5) as stub:
            yield stub


@pytest.fixture(scope="module")
def push_decode(launcher: Launcher, tiny_llama: Path) -> Proc:
    proc = launcher.serve(tiny_llama, "--kv-role", "decode", "--kv-transfer", "push", "--num-gpu-blocks", "64")
    launcher.wait_ready()
    return proc


@pytest.mark.parametrize("stream", [False, True])
def test_push_prefill_failure_cancels_decode(
    launcher: Launcher, stub_prefill: StubBackend, push_decode: Proc, stream: bool
) -> None:
    router = _router(launcher, "push", stub_prefill.url, push_decode.url)
    request_id = f"doomed-{uuid.uuid4().hex}"
    started = time.monotonic()
    body = {"prompt": "x" * 40, "max_tokens": 5, "stream": stream}
    resp = post(router.url, "/v1/completions", body, {"X-Request-Id": request_id})
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert "prefill" in message and stub_prefill.url in message and "prefill exploded" in message, message
    assert time.monotonic() - started < 10  # not D's receive timeout
    m = wait_idle(push_decode.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], m
    assert f"client_id={request_id} status=499" in push_decode.log_text()  # D had the request and aborted it
