"""Sampling values that used to kill the engine loop (issue 12): a real `pdserve serve` (tiny random Llama,
--kv-role both) answers a tiny temperature greedily, refuses non-finite values with a 400 naming the field,
and keeps serving afterwards."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, joined_stream, post, stream_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(launcher: Launcher, tiny_llama: Path) -> Proc:
    proc = launcher.serve(tiny_llama, "--kv-role", "both", "--num-gpu-blocks", "64", name="server")
    launcher.wait_ready()
    return proc


def _completion(server: Proc, **fields: object) -> httpx.Response:
    return post(server.url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 6, **GREEDY, **fields})


def test_tiny_temperature_is_greedy_and_the_server_lives(server: Proc) -> None:
    greedy = _completion(server)
    assert greedy.status_code == 200, greedy.text
    greedy_ids = greedy.json()["choices"][0]["token_ids"]
    for temperature in (1e-40, 1e-300):
        resp = _completion(server, temperature=temperature)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == greedy_ids
    body = {"prompt": "Hello there", "max_tokens": 6, **GREEDY, "temperature": 1e-40, "stream": True}
    _, ids, _ = joined_stream(stream_events(server.url, "/v1/completions", body))
    assert ids == greedy_ids
    chat = post(
        server.url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1e-300},
    )
    assert chat.status_code == 200, chat.text
    after = _completion(server, temperature=0.7, seed=3)  # the engine loop is still alive
    assert after.status_code == 200, after.text
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200


@pytest.mark.parametrize(("field", "raw"), [("temperature", "Infinity"), ("temperature", "NaN"), ("top_p", "NaN")])
def test_non_finite_value_is_a_400_naming_the_field(server: Proc, field: str, raw: str) -> None:
    # json= would refuse to encode nan/inf; Python's json (and so the server) reads these tokens
    content = f'{{"prompt": "Hello", "max_tokens": 4, "{field}": {raw}}}'
    resp = httpx.post(
        server.url + "/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
        trust_env=False,
    )
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]
    assert _completion(server).status_code == 200
