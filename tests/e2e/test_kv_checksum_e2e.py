"""--kv-checksum end to end (real servers, router, NIXL, rank processes), TP 2 on one side, both modes: intact
transfers pass and equal a colocated TP 1 instance token for token; a byte flipped in D's received KV (the
test-only Faults.flip_kv_byte) is caught on every request and never answered with a 200 built on it: an
error with --kv-load-failure-policy fail, the colocated tokens with recompute; pdserve_kv_checksum_failures_total
counts them, and every block is free afterwards on both sides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import Launcher, post, scrape_metrics, wait_idle

from pdserve.transfer.faults import Faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["The quick brown fox jumps over the lazy dog; " * 2, "A checksum over KV blocks " * 3, "x"]


def _body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def reference(launcher: Launcher, tiny_llama: Path) -> Callable[[], list[dict[str, Any]]]:
    """The colocated TP 1 answer's choice to each prompt, asked for once: one reference instance for both cases,
    started here and waited for at the first call (it loads alongside the first case's instances)."""
    ref = launcher.serve(tiny_llama, name="ref")
    choices: list[dict[str, Any]] = []

    def want() -> list[dict[str, Any]]:
        if not choices:
            launcher.wait_ready()
            choices.extend(post(ref.url, "/v1/completions", _body(t)).json()["choices"][0] for t in PROMPTS)
        return choices

    return want


@pytest.mark.parametrize(("mode", "p_tp", "d_tp", "policy"), [("pull", 2, 1, "fail"), ("push", 1, 2, "recompute")])
def test_flip_is_caught(
    fresh_launcher: Launcher,
    tiny_llama: Path,
    reference: Callable[[], list[dict[str, Any]]],
    mode: str,
    p_tp: int,
    d_tp: int,
    policy: str,
) -> None:
    on = ("--kv-transfer", mode, "--kv-checksum")
    p = fresh_launcher.serve(tiny_llama, "--kv-role", "prefill", "--tensor-parallel-size", str(p_tp), *on, name="p")
    d_args = ("--kv-role", "decode", "--tensor-parallel-size", str(d_tp), *on, "--kv-load-failure-policy", policy)
    d_ok = fresh_launcher.serve(tiny_llama, *d_args, name="d_ok")
    d_bad = fresh_launcher.serve(tiny_llama, *d_args, name="d_flip", faults=Faults(flip_kv_byte=True))
    fresh_launcher.wait_ready()
    to_ok, to_bad = fresh_launcher.proxy(mode, [p], [d_ok]), fresh_launcher.proxy(mode, [p], [d_bad])
    fresh_launcher.wait_ready()
    want = reference()
    for prompt, ref_choice in zip(PROMPTS, want, strict=True):
        got = post(to_ok.url, "/v1/completions", _body(prompt))
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == ref_choice["token_ids"]
    transferred = 0
    for prompt, ref_choice in zip(PROMPTS, want, strict=True):
        got = post(to_bad.url, "/v1/completions", _body(prompt))
        moves_kv = len(ref_choice["prompt_token_ids"]) > 1  # D computes the last prompt token itself
        transferred += moves_kv
        if policy == "fail" and moves_kv:
            assert got.status_code != 200 and "KV checksum mismatch" in got.text, got.text
        else:  # recomputed locally (or nothing received): the colocated answer
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["token_ids"] == ref_choice["token_ids"]
    assert scrape_metrics(d_ok.url)["pdserve_kv_checksum_failures_total"] == 0
    # each D rank checks its own part and counts its mismatch, unless the other rank's failure cancelled it first
    failures = scrape_metrics(d_bad.url)["pdserve_kv_checksum_failures_total"]
    assert transferred <= failures <= transferred * d_tp, (failures, transferred)
    for inst in (p, d_ok, d_bad):
        m = wait_idle(inst.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], m
