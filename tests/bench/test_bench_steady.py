"""Steady-state figures: TTFT/TPOT median per quarter of the run (by arrival), drift, the plot over the run,
the summary table's columns, and a 1,000-request run through the real client against a fake streaming server."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.bench import cli_plot
from pdserve.bench.client import ClientConfig, RequestOutput
from pdserve.bench.dataset import SampleRequest
from pdserve.bench.metrics import (
    calculate_metrics,
    drift_ratio,
    format_summary,
    quarter_medians_ms,
    split_quarters,
)
from pdserve.bench.plot import summary_rows
from pdserve.bench.points import load_results
from pdserve.bench.runner import LoadConfig, run_load
from pdserve.bench.sweep_config import point_stem

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_split_quarters_keeps_order_and_balances_sizes() -> None:
    assert split_quarters(list(range(10))) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert split_quarters([1, 2]) == [[1], [2], [], []]
    assert [len(q) for q in split_quarters(list(range(1000)))] == [250] * 4


def test_quarter_medians_from_a_known_list() -> None:
    # seconds, in arrival order; None = a failed request (left out of its quarter)
    values = [0.01, 0.03, 0.02, None, 0.05, 0.04, 0.10, 0.30, None, 0.20, 0.40, 0.60]
    # quarters: [10, 30, 20] [-, 50, 40] [100, 300, -] [200, 400, 600] ms
    assert quarter_medians_ms(values) == pytest.approx([20.0, 45.0, 200.0, 400.0])
    assert drift_ratio(quarter_medians_ms(values)) == pytest.approx(20.0)
    assert quarter_medians_ms([0.1, None, 0.3]) == pytest.approx([100.0, None, 300.0, None])
    assert drift_ratio([10.0, 1.0, 1.0, None]) is None and drift_ratio([0.0, 1.0, 1.0, 5.0]) is None


def _run_outputs(ttfts: list[float], num_tokens: int = 5) -> list[RequestOutput]:
    """TTFT as given (0 = failed); TPOT 10 ms for the first half of the run, 20 ms for the second."""
    outs = []
    for i, ttft in enumerate(ttfts):
        if ttft == 0:
            outs.append(RequestOutput(f"r{i}", False, prompt_len=8, error="HTTP 503: busy"))
            continue
        tpot = 0.01 if i < len(ttfts) / 2 else 0.02
        itl = [tpot] * (num_tokens - 1)
        outs.append(RequestOutput(f"r{i}", True, 8, num_tokens, ttft, itl, ttft + tpot * (num_tokens - 1)))
    return outs


def test_result_json_has_quarter_medians_and_keeps_vllm_keys() -> None:
    ttfts = [0.1, 0.1, 0.2, 0.2, 0.0, 0.4, 0.8, 0.8]  # quarters: [100,100] [200,200] [-,400] [800,800]
    r = calculate_metrics(_run_outputs(ttfts), duration=4.0)
    assert r["ttft_quarter_medians_ms"] == pytest.approx([100.0, 200.0, 400.0, 800.0])
    assert r["ttft_drift"] == pytest.approx(8.0)
    assert r["tpot_quarter_medians_ms"] == pytest.approx([10.0, 10.0, 20.0, 20.0])
    assert r["tpot_drift"] == pytest.approx(2.0)
    for key in ("median_ttft_ms", "p99_ttft_ms", "ttfts", "itls", "completed", "failed", "request_throughput"):
        assert key in r  # vllm bench serve's names are still there
    json.dumps(r)  # None for empty quarters serialises
    summary = format_summary(r)
    assert "TTFT per quarter (ms):" in summary and "100.0 / 200.0 / 400.0 / 800.0" in summary
    assert "TTFT drift (last/first quarter):" in summary and "8.00" in summary


def _write_point(root: Path, mode: str, ttfts: list[float], iteration: int = 0, qps: float = 8.0) -> None:
    result = calculate_metrics(_run_outputs(ttfts), duration=1.0)
    result.update(mode=mode, qps=qps, iteration=iteration, input_len=4096, output_len=5)
    (root / f"{point_stem(mode, qps, 4096, 5, iteration)}.json").write_text(json.dumps(result))


def test_summary_table_shows_quarters_and_drift(tmp_path: Path) -> None:
    _write_point(tmp_path, "push", [0.036, 0.034, 0.134, 0.092])
    _write_point(tmp_path, "pull", [0.037, 0.037, 3.696, 6.661])
    table = summary_rows(load_results([tmp_path]))
    header = table.splitlines()[1]
    for column in ("push TTFT q1/q2/q3/q4", "push drift", "pull TTFT q1/q2/q3/q4", "pull drift"):
        assert column in header
    row = table.splitlines()[3]
    assert "36/34/134/92" in row and "2.56" in row  # push: 92 / 36
    assert "37/37/3696/6661" in row and "180.03" in row  # pull: 6661 / 37


def test_iterations_pool_quarter_by_quarter(tmp_path: Path) -> None:
    _write_point(tmp_path, "push", [0.1, 0.2, 0.3, 0.4], iteration=0)
    _write_point(tmp_path, "push", [0.3, 0.4, 0.5, 0.6], iteration=1)
    (point,) = load_results([tmp_path])
    assert point.quarter_medians("ttft") == pytest.approx([200.0, 300.0, 400.0, 500.0])
    assert point.drift("ttft") == pytest.approx(2.5)


def test_plot_writes_the_over_run_png_beside_the_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for mode, slope in (("push", 0.001), ("pull", 0.01)):
        for qps in (4.0, 8.0):
            _write_point(tmp_path, mode, [0.05 + slope * i for i in range(40)], qps=qps)
    parser = argparse.ArgumentParser()
    cli_plot.add_arguments(parser)
    assert cli_plot.run(parser.parse_args(["--results-dir", str(tmp_path)])) == 0
    for name in ("ttft.png", "ttft_over_run.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert int.from_bytes(data[16:20], "big") > 400  # IHDR width
    printed = capsys.readouterr().out
    assert printed.count("TTFT per quarter") == 4  # 2 modes x 2 rates
    assert "plot over the run written to" in printed
    assert cli_plot.run(parser.parse_args(["--results-dir", str(tmp_path), "--metric", "itl"])) == 0
    assert not (tmp_path / "itl_over_run.png").exists()  # many values per request: no over-run plot


def _fake_server(num_tokens: int) -> web.Application:
    """A streaming completions endpoint that answers `num_tokens` one-token chunks at once."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(num_tokens):
            chunk = {"choices": [{"text": "x", "token_ids": [i], "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": num_tokens}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_thousand_requests_through_the_client() -> None:
    num, num_tokens = 1000, 4

    async def main() -> tuple[list[RequestOutput], float, float]:
        runner = web.AppRunner(_fake_server(num_tokens))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = ClientConfig(api_url=f"http://127.0.0.1:{port}/v1/completions", model="m", is_chat=False)
        requests = [SampleRequest(f"req-{i}", [1, 2, 3], 3, num_tokens) for i in range(num)]
        warmups = [SampleRequest(f"warm-{i}", [1], 1, num_tokens) for i in range(5)]
        load = LoadConfig(max_concurrency=None, show_progress=False)  # all at once: 1,000 connections
        start = time.perf_counter()
        try:
            outputs, duration = await run_load(client, requests, load, warmups)
        finally:
            await runner.cleanup()
        return outputs, duration, time.perf_counter() - start

    outputs, duration, wall = asyncio.run(main())
    assert [o.request_id for o in outputs] == [f"req-{i}" for i in range(num)]  # warm-ups are not measured
    assert all(o.success and o.output_tokens == num_tokens for o in outputs), [o.error for o in outputs][:3]
    start = time.perf_counter()
    r = calculate_metrics(outputs, duration)
    assert time.perf_counter() - start < 5.0  # linear: a quadratic pass over 1,000 requests would show here
    assert r["completed"] == num and all(q is not None for q in r["ttft_quarter_medians_ms"])
    assert wall < 120.0
