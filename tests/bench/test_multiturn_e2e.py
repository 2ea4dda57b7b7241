"""`pdserve bench --dataset multiturn` against a live colocated deployment of the tiny model: every turn sent
after its predecessor's answer and the think time, every history resent whole, the new keys in the JSON,
and every KV block free afterwards."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench import cli_bench
from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.scrape import scrape_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

USERS, TURNS, SYSTEM, TURN, OUTPUT, THINK = 3, 3, 32, 16, 6, 0.2  # last prompt 32 + 3*16 + 2*6 = 92 of 256


@pytest.fixture(scope="module")
def colocated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two `--kv-role both` instances + router on the tiny model, one torch thread each; stopped after the module."""
    logs = tmp_path_factory.mktemp("colocated-logs")
    options = ServerOptions(model=str(tiny_model), num_threads=1)
    with Deployment(options, "colocated", logs, startup_timeout_s=240) as deployment:
        yield deployment


def _all_blocks_free(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        busy = m["pdserve_requests_running"] + m["pdserve_requests_waiting"]
        if (busy == 0 and m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_multiturn_turns_wait_for_their_answers(colocated: Deployment, tiny_model: Path, tmp_path: Path) -> None:
    argv = ["--base-url", colocated.router_url, "--tokenizer", str(tiny_model), "--dataset", "multiturn"]
    argv += ["--num-users", str(USERS), "--num-turns", str(TURNS), "--system-prompt-len", str(SYSTEM)]
    argv += ["--input-len", str(TURN), "--output-len", str(OUTPUT), "--think-time", str(THINK), "--ignore-eos"]
    argv += ["--request-rate", "20", "--seed", "3", "--num-warmups", "1", "--request-id-prefix", "mt"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "mt.json", "--disable-tqdm"]
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    assert cli_bench.run(parser.parse_args(argv)) == 0
    r = json.loads((tmp_path / "mt.json").read_text())

    num = USERS * TURNS
    assert (r["completed"], r["failed"]) == (num, 0), r["errors"]
    assert r["num_prompts"] == num and r["output_lens"] == [OUTPUT] * num and r["median_ttft_ms"] > 0
    assert r["dataset"] == "multiturn"
    params = {"num_users": USERS, "num_turns": TURNS, "system_prompt_len": SYSTEM, "turn_len": TURN}
    params |= {"think_time_s": THINK, "output_len": OUTPUT, "seed": 3, "random_range_ratio": 0.0}
    assert r["dataset_params"] == {**params, "max_prompt_len": SYSTEM + TURNS * TURN + (TURNS - 1) * OUTPUT}
    assert len(r["ttft_turn_medians_ms"]) == TURNS and all(t > 0 for t in r["ttft_turn_medians_ms"])
    assert r["start_times"] == sorted(r["start_times"])  # send order

    rows = {(u, t): i for i, (u, t) in enumerate(zip(r["users"], r["turns"], strict=True))}
    assert sorted(rows) == [(u, t) for u in range(USERS) for t in range(TURNS)]
    for (user, turn), i in rows.items():
        assert r["request_ids"][i] == f"mt-{user}-{turn}"
        if turn == 0:
            assert r["input_lens"][i] == SYSTEM + TURN  # the server's count (usage)
            continue
        before = rows[(user, turn - 1)]
        assert r["start_times"][i] >= r["start_times"][before] + r["latencies"][before] + THINK
        assert r["input_lens"][i] == r["input_lens"][before] + OUTPUT + TURN  # the whole history, resent

    for url in colocated.instance_urls:  # several requests later, nothing held
        m = _all_blocks_free(url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], (url, m)
