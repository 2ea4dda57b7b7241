"""`pdserve sweep` over a tiny grid: exactly the named files, and no process left behind (also on Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.bench.phases import PHASES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
MODES = ("push", "pull")


Marked = tuple[str, Callable[[str], list[int]]]


def _sweep(model: Path, results: Path, marker_var: str, marker: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdserve.cli", "sweep", str(model), "--tokenizer", str(model)]
    argv += ["--results-dir", str(results), "--num-threads", "1", "--startup-timeout", "240", *extra]
    env = {**os.environ, marker_var: marker, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _assert_no_process_left(find: Callable[[str], list[int]], marker: str) -> None:
    deadline = time.monotonic() + 10
    while find(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert find(marker) == []


def test_sweep_writes_exactly_the_named_files(tiny_model: Path, tmp_path: Path, marked_processes: Marked) -> None:
    marker_var, find = marked_processes
    marker = uuid.uuid4().hex
    results = tmp_path / "sweep"
    grid = ["--modes", ",".join(MODES), "--qps", "inf", "--input-lens", "16,32", "--output-lens", "4"]
    grid += ["--num-prompts", "3", "--iterations", "1", "--num-warmups", "1"]
    proc = _sweep(tiny_model, results, marker_var, marker, *grid)
    try:
        output, _ = proc.communicate(timeout=540)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    expected = {f"{mode}_qpsinf_in{n}_out4_iter0.{ext}" for mode in MODES for n in (16, 32) for ext in ("json", "log")}
    assert {p.name for p in results.iterdir() if p.is_file()} == expected
    for name in expected:
        if name.endswith(".json"):
            r = json.loads((results / name).read_text())
            assert (r["completed"], r["failed"]) == (3, 0), (name, r["errors"])
            assert r["mode"] == name.split("_")[0] and r["output_lens"] == [4, 4, 4]
            # where the time went: every phase of the mode, for every request (bench/phases.py)
            assert r["phase_counts"] == {label: 3 for label, _, _ in PHASES[r["mode"]]}, r["phase_counts"]
            assert all(v >= 0 for v in r["phase_medians_ms"].values())
            # each instance's counters over the point (bench/instances.py): the warm-up is not in them
            p, d = r["instances"]
            assert (p["role"], d["role"], p["requests"], d["requests"]) == ("prefill", "decode", 3, 3), r["instances"]
            assert p["prompt_tokens"] == d["prompt_tokens"] == sum(r["input_lens"]) > 0, r["instances"]
            assert 0 <= p["prefix_hit_tokens"] <= p["prompt_tokens"] and d["prefix_hit_tokens"] == 0  # D: no cache
            assert p["kv_sent_bytes"] == d["kv_received_bytes"] > 0 and p["kv_received_bytes"] == 0, r["instances"]
            assert r["kv_bytes_per_request"] == d["kv_received_bytes"] / 3
            assert r["prefix_hit_rate"] == p["prefix_hit_tokens"] / (2 * p["prompt_tokens"])
        else:
            assert "pdserve bench" in (results / name).read_text()
    assert "push/pull" in output and "where the time to first token goes" in output and "hand-over" in output
    assert "per instance (deltas over the point)" in output and "D1 3 req, hit 0%" in output
    _assert_no_process_left(find, marker)


def test_sweep_interrupted_leaves_no_process(tiny_model: Path, tmp_path: Path, marked_processes: Marked) -> None:
    marker_var, find = marked_processes
    marker = uuid.uuid4().hex
    grid = ["--modes", "pull", "--qps", "1", "--input-lens", "32", "--output-lens", "8", "--num-prompts", "200"]
    proc = _sweep(tiny_model, tmp_path / "sweep", marker_var, marker, *grid)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the servers are up and the load is running
            if "warming up" in line:
                break
        time.sleep(2.0)
        assert len(find(marker)) >= 4  # sweep, prefill, decode, router
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers (the servers are in their own sessions)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    _assert_no_process_left(find, marker)


def test_sweep_colocated_with_goodput_search(tiny_model: Path, tmp_path: Path, marked_processes: Marked) -> None:
    """colocated beside pull, SLOs every request meets: goodput keys in every JSON, the search runs every rate."""
    marker_var, find = marked_processes
    marker = uuid.uuid4().hex
    results = tmp_path / "sweep"
    grid = ["--modes", "pull,colocated", "--qps", "8,4", "--input-lens", "16", "--output-lens", "4"]
    grid += ["--num-prompts", "3", "--num-warmups", "1", "--goodput", "ttft:60000", "tpot:60000"]
    proc = _sweep(tiny_model, results, marker_var, marker, *grid, "--find-max-goodput", "--interleave")
    try:
        output, _ = proc.communicate(timeout=540)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    stems = {f"{mode}_qps{q}_in16_out4_iter0" for mode in ("pull", "colocated") for q in (4, 8)}
    files = {p.name for p in results.iterdir() if p.is_file()}
    assert files == {f"{s}.{ext}" for s in stems for ext in ("json", "log")} | {"max_goodput.json", "attainment.png"}
    for stem in stems:
        r = json.loads((results / f"{stem}.json").read_text())
        assert (r["completed"], r["slo_attainment"]) == (3, 1.0), r["errors"]
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])
        assert r["goodput_slos_ms"] == {"ttft": 60000.0, "tpot": 60000.0}
        assert r["phase_counts"] == {label: 3 for label, _, _ in PHASES[r["mode"]]}, r["phase_counts"]
    summary = json.loads((results / "max_goodput.json").read_text())
    assert {(m["mode"], m["max_qps"]) for m in summary["results"]} == {("pull", 8.0), ("colocated", 8.0)}
    assert "colocated SLO%" in output and "in 16 out 4 colocated: 8 req/s" in output
    router_log = (results / "servers" / "colocated_router.log").read_text()
    for i in range(2):  # both instances served requests
        instance = (results / "servers" / f"colocated_instance{i}.log").read_text()
        assert "status=200" in instance and "--kv-role both" in instance
    assert "mode=colocated route=whole" in router_log
    _assert_no_process_left(find, marker)
