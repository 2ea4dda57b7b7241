"""Aggregation math of pdserve.bench.metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import calculate_metrics, format_summary, parse_goodput, percentile_key
from pdserve.bench.runner import arrival_offsets


def _outputs() -> list[RequestOutput]:
    return [
        # TPOT (0.2 - 0.1) / 3 = 33.33 ms
        RequestOutput("a", True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        # TPOT (0.4 - 0.3) / 1 = 100 ms
        RequestOutput("b", True, prompt_len=20, output_tokens=2, ttft=0.3, itl=[0.1], latency=0.4),
        RequestOutput("c", False, prompt_len=30, error="HTTP 500: boom"),
        # one token: no TPOT (counts as 0 for goodput)
        RequestOutput("d", True, prompt_len=5, output_tokens=1, ttft=0.2, itl=[], latency=0.2),
    ]


def test_counts_and_throughputs() -> None:
    r = calculate_metrics(_outputs(), duration=2.0)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 35  # successful requests only
    assert r["total_output_tokens"] == 7
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(21.0)
    assert r["request_goodput"] is None  # no SLO given
    assert r["input_lens"] == [10, 20, 30, 5]
    assert r["output_lens"] == [4, 2, 0, 1]
    assert r["errors"] == ["", "", "HTTP 500: boom", ""]
    assert r["ttfts"] == [0.1, 0.3, 0.0, 0.2]
    assert r["itls"][0] == [0.02, 0.03, 0.05]


def test_statistics_in_ms() -> None:
    r = calculate_metrics(_outputs(), duration=2.0)
    # TTFT over [100, 200, 300] ms
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert r["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation: 200 + 0.8 * 100
    assert r["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT over [33.33, 100] ms; the one-token request is left out
    assert r["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert r["median_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert r["p90_tpot_ms"] == pytest.approx(100 / 3 + 0.9 * (100 - 100 / 3))
    # ITL pools every gap: [20, 30, 50, 100] ms
    assert r["mean_itl_ms"] == pytest.approx(50.0)
    assert r["median_itl_ms"] == pytest.approx(40.0)
    assert r["p99_itl_ms"] == pytest.approx(50 + 0.97 * 50)
    # E2EL over [200, 400, 200] ms
    assert r["mean_e2el_ms"] == pytest.approx(800 / 3)
    assert r["median_e2el_ms"] == pytest.approx(200.0)
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{key}_ms" in r


def test_goodput() -> None:
    slos = parse_goodput(["ttft:250", "tpot:50"])
    assert slos == {"ttft": 250.0, "tpot": 50.0}
    r = calculate_metrics(_outputs(), duration=2.0, goodput=slos)
    # a: ttft 100 ms, tpot 33 ms -> good; b: ttft 300 ms -> bad; d: ttft 200 ms, tpot 0 -> good
    assert r["request_goodput"] == pytest.approx(1.0)
    assert "Request goodput (req/s):" in format_summary(r)


def test_all_failed_reports_zeros() -> None:
    r = calculate_metrics([RequestOutput("x", False, prompt_len=3, error="refused")], duration=1.0)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (0, 1, 0)
    assert r["mean_ttft_ms"] == 0.0 and r["p99_e2el_ms"] == 0.0
    assert "error 0: refused" in format_summary(r)


@pytest.mark.parametrize("bad", [["ttft"], ["latency:10"], ["tpot:-1"]])
def test_bad_goodput_is_refused(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_percentile_key() -> None:
    assert percentile_key(90.0) == "p90"
    assert percentile_key(99.9) == "p99.9"


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    offsets = arrival_offsets(50, 5.0, 1.0, seed=3)
    assert offsets == arrival_offsets(50, 5.0, 1.0, seed=3)  # seeded
    assert offsets != arrival_offsets(50, 5.0, 1.0, seed=4)
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] == pytest.approx(50 / 5.0)  # rescaled: the offered load is exactly the rate
    assert arrival_offsets(3, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5])  # constant gaps
