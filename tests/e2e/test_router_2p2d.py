"""2P2D behind one router (D instances with different block sizes): every instance takes a share of a
concurrent batch, the answers equal a colocated server's, and every block comes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import Launcher, post, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 8}
PROMPTS = [f"Request number {i}: " + "abcdefgh"[: i + 1] * (3 * i + 1) for i in range(8)]


@pytest.mark.parametrize("mode", ["push", "pull"])  # 5 processes each: ~40 s per mode on 2 cores
def test_2p2d_equal_colocated(fresh_launcher: Launcher, tiny_llama: Path, mode: str) -> None:
    launch = fresh_launcher
    common = ["--kv-transfer", mode, "--num-gpu-blocks", "64"]
    reference = launch.serve(tiny_llama, "--num-gpu-blocks", "64", name="reference")
    prefills = [launch.serve(tiny_llama, "--kv-role", "prefill", *common, name=f"P{i}") for i in range(2)]
    decodes = [
        launch.serve(tiny_llama, "--kv-role", "decode", "--block-size", str(bs), *common, name=f"D{i}")
        for i, bs in enumerate((16, 32))
    ]
    launch.wait_ready()
    router = launch.proxy(mode, prefills, decodes, name="router")
    launch.wait_ready()

    def ask(url: str, prompt: str) -> tuple[str, list[int]]:
        resp = post(url, "/v1/completions", {"prompt": prompt, **GREEDY})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return choice["text"], choice["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        expected = list(pool.map(lambda p: ask(reference.url, p), PROMPTS))
        got = list(pool.map(lambda p: ask(router.url, p), PROMPTS))
    assert got == expected
    for proc in prefills + decodes:
        assert httpx.get(proc.url + "/timeline").json(), f"{proc.name} served nothing"
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name
    for d in decodes:
        assert wait_idle(d.url)["pdserve_kv_received_bytes_total"] > 0, d.name
