"""Tensor-parallel P/D over real processes (rank processes, gloo, real NIXL). Equality with a colocated TP 1
instance for every pair of TP sizes, both modes, over several requests per deployment, with one confirmation
per (D rank, P rank) on D's timeline and one transfer part per pair on P's, is the combination matrix's
(test_matrix.py). Here:
A rank of P or D SIGKILLed mid-transfer fails the request within seconds and the other instance frees its blocks.
tiny llama has 2 KV heads: at TP 2 each rank holds one. A hybrid model (tiny Gemma 3: a full and a windowed KV
group, 2 KV heads) moves every group's table across TP sizes too, past its window."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import Launcher, Proc, post, scrape_metrics, wait_idle

from pdserve.transfer.faults import Faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = {"prompt": "The quick brown fox jumps over the lazy dog; " * 2, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
GEMMA_COMMON = ("--num-gpu-blocks", "64", "--block-size", "4")
GEMMA_BODY = {**BODY, "prompt": "sliding windows: " + "abcdefgh" * 4 + "abcdef", "max_tokens": 12}


@pytest.fixture(scope="module")
def gemma_reference(launcher: Launcher, tiny_model_dirs: dict[str, Path]) -> Callable[[], dict[str, Any]]:
    """The colocated TP 1 answer's choice to GEMMA_BODY, asked for once: one reference instance for every case,
    started here and waited for at the first call (it loads alongside the first case's instances)."""
    ref = launcher.serve(tiny_model_dirs["gemma3"], *GEMMA_COMMON, name="gemma_ref")
    choices: list[dict[str, Any]] = []

    def want() -> dict[str, Any]:
        if not choices:
            launcher.wait_ready()
            choices.append(post(ref.url, "/v1/completions", GEMMA_BODY).json()["choices"][0])
        return choices[0]

    return want


@pytest.mark.parametrize(("mode", "p_tp", "d_tp"), [("pull", 2, 1), ("push", 2, 1), ("push", 1, 2)])
def test_tp_pd_several_kv_groups(
    fresh_launcher: Launcher,
    tiny_model_dirs: dict[str, Path],
    gemma_reference: Callable[[], dict[str, Any]],
    mode: str,
    p_tp: int,
    d_tp: int,
) -> None:
    """Tiny Gemma 3 (layers 0, 2: window 6; layers 1, 3: full; block size 4) across TP sizes, a prompt of 56
    tokens: == colocated TP 1 token for token; what D's ranks received is what P's ranks sent, and no more than
    the colocated prompt's KV (the windowed group moves only its window); every block free afterwards."""
    model, common, body = tiny_model_dirs["gemma3"], GEMMA_COMMON, GEMMA_BODY
    p = fresh_launcher.serve(model, *common, "--kv-transfer", mode, "--kv-role", "prefill",
                             "--tensor-parallel-size", str(p_tp), name="p")  # fmt: skip
    d = fresh_launcher.serve(model, *common, "--kv-transfer", mode, "--kv-role", "decode",
                             "--tensor-parallel-size", str(d_tp), name="d")  # fmt: skip
    fresh_launcher.wait_ready()
    router = fresh_launcher.proxy(mode, [p], [d])
    fresh_launcher.wait_ready()
    want = gemma_reference()
    got = post(router.url, "/v1/completions", body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want["token_ids"]
    assert len(want["prompt_token_ids"]) == 56
    for inst in (p, d):
        m = wait_idle(inst.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == 64, m
    received = scrape_metrics(d.url)["pdserve_kv_received_bytes_total"]
    assert received == scrape_metrics(p.url)["pdserve_kv_sent_bytes_total"]
    token_bytes = 2 * 2 * 2 * 16 * 4  # one group: 2 layers x K, V x 2 KV heads x head_dim 16 x float32
    # D receives all 56 prompt tokens (P hands its first token over): the full group moves blocks [0, 14), the
    # windowed group only blocks [12, 14), which hold the keys (50, 56] the first output token's query at 56 reads
    full, windowed = 14 * 4, (14 - (56 - 6 + 1) // 4) * 4
    assert received == (full + windowed) * token_bytes, received


def _rank_pid(engine: Proc, rank: int) -> int:
    """The pid of a TP instance's rank process (rank >= 1; ranks are spawned children of the engine process, in
    rank order; the resource tracker is not one)."""
    children: list[int] = []
    for task in Path(f"/proc/{engine.popen.pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    ranks = [c for c in sorted(children) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return ranks[rank - 1]


@pytest.mark.parametrize(("mode", "killed"), [("push", "p"), ("push", "d"), ("pull", "p"), ("pull", "d")])
def test_rank_killed_mid_transfer(fresh_launcher: Launcher, tiny_llama: Path, mode: str, killed: str) -> None:
    """P TP 2 -> D TP 2 with the transfer held in flight 4 s (push: P holds the finished prefill back, both D
    ranks registered; pull: D holds its READs back, P's blocks pinned): rank 1 of P or of D is SIGKILLed
    meanwhile. The request fails with an error naming the rank within seconds (no hang), and the other
    instance frees every block."""
    common = ("--kv-transfer", mode, "--tensor-parallel-size", "2")
    held = {"push": ("p", Faults(delay_send_ready_s=4.0)), "pull": ("d", Faults(delay_read_s=4.0))}[mode]
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", *common, name="p",
                             faults=held[1] if held[0] == "p" else None)  # fmt: skip
    d = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", *common, name="d",
                             faults=held[1] if held[0] == "d" else None)  # fmt: skip
    fresh_launcher.wait_ready()
    router = fresh_launcher.proxy(mode, [p], [d])
    fresh_launcher.wait_ready()
    victim, survivor = (p, d) if killed == "p" else (d, p)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answer = pool.submit(post, router.url, "/v1/completions", BODY, {"X-Request-Id": "tp-kill"})
        time.sleep(2.0)  # prefilled (and, push, registered); the transfer is still held back
        os.kill(_rank_pid(victim, 1), signal.SIGKILL)
        got = answer.result(timeout=30)
    assert time.monotonic() - started < 20
    assert got.status_code != 200 or "error" in got.text, got.text
    assert "rank" in got.text, got.text
    m = wait_idle(survivor.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], m
