"""Tensor-parallel P/D over real processes (rank processes, gloo, real NIXL): 1P1D through the router equals a
colocated TP 1 instance token for token, in both modes, for P TP 2 -> D TP 1, P TP 1 -> D TP 2 and
P TP 2 -> D TP 2; afterwards every block is free, and D's timeline shows exactly one confirmation
(pull: PullReleaseAck) per (D rank, P rank), or one PushDone per P rank holding the D rank's heads (push).
A rank of P or D SIGKILLed mid-transfer fails the request within seconds and the other instance frees its blocks.
tiny llama has 2 KV heads: at TP 2 each rank holds one."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, post, wait_idle

from pdserve.transfer.faults import Faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = {"prompt": "The quick brown fox jumps over the lazy dog; " * 2, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def _events(url: str, client_id: str) -> dict[str, float]:
    for tl in httpx.get(url + "/timeline", timeout=10, trust_env=False).json():
        if tl.get("client_request_id") == client_id:
            return tl["events"]
    raise AssertionError(f"no timeline for {client_id} at {url}")


@pytest.mark.parametrize(
    ("mode", "p_tp", "d_tp"),
    [("pull", 2, 1), ("pull", 1, 2), ("pull", 2, 2), ("push", 2, 1), ("push", 1, 2), ("push", 2, 2)],
)
def test_tp_pd_equals_tp1(fresh_launcher: Launcher, tiny_llama: Path, mode: str, p_tp: int, d_tp: int) -> None:
    ref = fresh_launcher.serve(tiny_llama, name="ref")
    common = ("--kv-transfer", mode)
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", "--tensor-parallel-size", str(p_tp), *common,
                             name="p")  # fmt: skip
    d = fresh_launcher.serve(tiny_llama, "--kv-role", "decode", "--tensor-parallel-size", str(d_tp), *common,
                             name="d")  # fmt: skip
    fresh_launcher.wait_ready()
    router = fresh_launcher.proxy(mode, [p], [d])
    fresh_launcher.wait_ready()
    want = post(ref.url, "/v1/completions", BODY)
    got = post(router.url, "/v1/completions", BODY, headers={"X-Request-Id": "tp-1"})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    for inst in (p, d):
        m = wait_idle(inst.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], m
    events = _events(d.url, "tp-1")
    if mode == "pull":
        want_names = {f"pull_ack.r{r}.p{q}" for r in range(d_tp) for q in range(p_tp)}
        got_names = {e for e in events if e.startswith("pull_ack.")}
    else:  # D rank r gets its heads from the P ranks holding them: P TP 1 -> its rank 0; equal TP -> rank r
        want_names = {
            f"push_done.r{r}.p{q}" for r in range(d_tp) for q in range(p_tp) if p_tp == 1 or d_tp == 1 or q == r
        }
        got_names = {e for e in events if e.startswith("push_done.")}
    assert got_names == want_names, events


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
