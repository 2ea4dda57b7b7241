"""`pdserve bench` against a live tiny 1P1D deployment: the result JSON has sane values, timelines join."""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench import cli_bench
from pdserve.bench.deploy import Deployment
from pdserve.bench.timeline import draw, join

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 40, 6


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_writes_sane_result(pull_deployment: Deployment, tiny_model: Path, tmp_path: Path) -> None:
    argv = ["--base-url", pull_deployment.router_url, "--tokenizer", str(tiny_model), "--seed", "11"]
    argv += ["--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
    argv += ["--request-rate", "20", "--ignore-eos", "--num-warmups", "1", "--goodput", "ttft:60000"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "r.json", "--request-id-prefix", "e2e"]
    assert cli_bench.run(_bench_args(argv)) == 0
    r = json.loads((tmp_path / "r.json").read_text())

    assert (r["completed"], r["failed"]) == (NUM_PROMPTS, 0), r["errors"]
    assert r["errors"] == [""] * NUM_PROMPTS
    assert r["input_lens"] == [INPUT_LEN] * NUM_PROMPTS  # exact: token-id prompts, confirmed by usage
    assert r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos
    assert r["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    for ttft, latency, itl in zip(r["ttfts"], r["latencies"], r["itls"], strict=True):
        assert 0 < ttft <= latency
        assert len(itl) <= OUTPUT_LEN - 1 and all(gap >= 0 for gap in itl)
        assert sum(itl) == pytest.approx(latency - ttft, abs=1e-6)
    assert 0 < r["median_ttft_ms"] <= r["median_e2el_ms"]
    assert r["p90_ttft_ms"] <= r["p99_ttft_ms"]
    assert r["request_throughput"] == pytest.approx(NUM_PROMPTS / r["duration"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s TTFT SLO is always met
    assert r["model_id"] and r["request_ids"] == [f"e2e-{i}" for i in range(NUM_PROMPTS)]

    # the servers' timelines carry the bench's request ids on both legs, and draw
    timelines = {}
    for role, url in (("prefill", pull_deployment.prefill_url), ("decode", pull_deployment.decode_url)):
        with urllib.request.urlopen(url + "/timeline", timeout=10) as response:
            timelines[role] = json.loads(response.read())
    joined = {t.request_id: t for t in join(timelines["prefill"], timelines["decode"])}
    for rid in r["request_ids"]:
        assert joined[rid].prefill and joined[rid].decode, rid
        assert joined[rid].event("D", "finished") >= joined[rid].event("P", "arrival")
    png = draw([("pull", [joined[rid] for rid in r["request_ids"]])], tmp_path / "timeline.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_chat_endpoint_reports_server_prompt_length(pull_deployment: Deployment, tiny_model: Path) -> None:
    argv = ["--base-url", pull_deployment.router_url, "--endpoint", "/v1/chat/completions"]
    argv += ["--tokenizer", str(tiny_model), "--num-prompts", "3", "--input-len", "24", "--output-len", "4"]
    argv += ["--ignore-eos", "--seed", "12", "--max-concurrency", "2", "--disable-tqdm", "--request-id-prefix", "chat"]
    r = asyncio.run(cli_bench.benchmark(_bench_args(argv), log=lambda _: None))
    assert (r["completed"], r["failed"]) == (3, 0), r["errors"]
    assert r["output_lens"] == [4, 4, 4]
    assert all(n > 24 for n in r["input_lens"])  # the chat template's tokens come on top of the text's
