"""The router when a backend is down or refuses: a 502 naming the leg and its URL, 503 health, 4xx passed on."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, free_port, post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def backend(launcher: Launcher, tiny_llama: Path) -> Proc:
    """A colocated instance; as a P leg it answers without kv_transfer_params, as a D leg it prefills."""
    proc = launcher.serve(tiny_llama, "--kv-role", "both", name="backend")
    launcher.wait_ready()
    return proc


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


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
def test_decode_down_is_502_naming_decode(launcher: Launcher, backend: Proc, dead_url: str, stream: bool) -> None:
    router = _router(launcher, "pull", backend.url, dead_url)
    resp = post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert resp.status_code == 502
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
