"""Goodput and SLO attainment from known per-request TTFT/TPOT, the highest sustained rate per mode, the
attainment plot, the sweep's search stopping a mode after its first failing rate, and the router's prompt
length estimate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench import cli_plot
from pdserve.bench.client import RequestOutput
from pdserve.bench.deploy import ServerOptions
from pdserve.bench.goodput import max_goodput, max_goodput_lines, rescore
from pdserve.bench.metrics import calculate_metrics, format_summary, parse_goodput
from pdserve.bench.plot import summary_rows
from pdserve.bench.points import load_results
from pdserve.bench.sweep import Sweep, pooled_attainment
from pdserve.bench.sweep_config import SweepConfig, point_stem
from pdserve.router.prompt_len import estimate_prompt_tokens

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _out(rid: str, ttft: float, tpot: float, num_tokens: int = 5, success: bool = True) -> RequestOutput:
    if not success:
        return RequestOutput(rid, False, prompt_len=8, error="HTTP 502: gone")
    latency = ttft + tpot * (num_tokens - 1)
    return RequestOutput(rid, True, 8, num_tokens, ttft, [tpot] * (num_tokens - 1), latency)


def test_goodput_and_attainment_from_known_requests() -> None:
    outs = [
        _out("a", ttft=0.5, tpot=0.020),  # meets both
        _out("b", ttft=1.5, tpot=0.020),  # TTFT too slow
        _out("c", ttft=0.9, tpot=0.030),  # TPOT too slow
        _out("d", ttft=1.0, tpot=0.024),  # exactly at the TTFT target: meets it
        _out("e", ttft=0.2, tpot=0.0, num_tokens=1),  # one token: TPOT counts as 0
        _out("f", 0, 0, success=False),  # failed: misses
    ]
    r = calculate_metrics(outs, duration=2.0, goodput=parse_goodput(["ttft:1000", "tpot:25"]))
    assert r["request_goodput"] == pytest.approx(3 / 2.0)  # a, d, e in 2 s
    assert r["slo_attainment"] == pytest.approx(3 / 6)
    assert "SLO attainment (%):" in format_summary(r) and "50.0" in format_summary(r)
    r = calculate_metrics(outs, duration=2.0, goodput=parse_goodput(["e2el:1000"]))
    # e2el: a 0.58, b 1.58, c 1.02, d 1.096, e 0.2 -> a and e
    assert r["slo_attainment"] == pytest.approx(2 / 6)
    assert calculate_metrics(outs, duration=2.0)["slo_attainment"] is None


def _write(root: Path, mode: str, qps: float, num_good: int, num: int = 10) -> None:
    outs = [_out(f"{mode}-{i}", 0.1 if i < num_good else 5.0, 0.01) for i in range(num)]
    result = calculate_metrics(outs, duration=num / qps, goodput={"ttft": 1000.0})
    result.update(mode=mode, qps=qps, iteration=0, input_len=64, output_len=5, goodput_slos_ms={"ttft": 1000.0})
    (root / f"{point_stem(mode, qps, 64, 5, 0)}.json").write_text(json.dumps(result))


def _write_search(root: Path) -> None:
    # pull holds 1 and 2 req/s, fails at 4; colocated holds 1, fails at 2 (and 4 is not run); push passes at
    # 1, fails at 2, passes at 4 (noise): the climb stops at 2 all the same
    for mode, good in (("pull", (10, 9, 5)), ("colocated", (10, 6)), ("push", (9, 8, 10))):
        for qps, num_good in zip((1.0, 2.0, 4.0), good, strict=False):
            _write(root, mode, qps, num_good)


def test_max_goodput_per_mode(tmp_path: Path) -> None:
    _write_search(tmp_path)
    points = load_results([tmp_path])
    found = {r.mode: r for r in max_goodput(points, 0.9)}
    assert (found["pull"].max_qps, found["pull"].first_failed_qps) == (2.0, 4.0)
    assert found["pull"].attainment == pytest.approx(0.9)
    assert found["pull"].goodput == pytest.approx(9 / 5.0)  # 9 good requests in 10 / 2 s
    assert (found["colocated"].max_qps, found["colocated"].first_failed_qps) == (1.0, 2.0)
    assert (found["push"].max_qps, found["push"].first_failed_qps) == (1.0, 2.0)
    lines = "\n".join(max_goodput_lines(list(found.values()), 0.9))
    assert "in 64 out 5 pull: 2 req/s" in lines and "max rate pull / colocated 2.00" in lines
    assert {r.mode: r.max_qps for r in max_goodput(points, 0.5)} == {"pull": 4.0, "colocated": 2.0, "push": 4.0}
    table = summary_rows(points)
    for column in ("push goodput", "pull SLO%", "colocated SLO%", "colocated TTFT", "push/pull"):
        assert column in table


def test_rescore_at_other_slos(tmp_path: Path) -> None:
    _write_search(tmp_path)
    points = load_results([tmp_path])
    same = rescore(points, {"ttft": 1000.0})
    for before, after in zip(points, same, strict=True):
        assert after.attainment() == pytest.approx(before.attainment())
        assert after.goodput() == pytest.approx(before.goodput())
    loose = rescore(points, {"ttft": 6000.0, "tpot": 10.5})  # every TTFT (<= 5 s) and TPOT (10 ms) within
    assert all(p.attainment() == pytest.approx(1.0) for p in loose)
    assert all(p.attainment() == 0.0 for p in rescore(points, {"tpot": 9.0}))


def test_plot_writes_attainment_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_search(tmp_path)
    parser = argparse.ArgumentParser()
    cli_plot.add_arguments(parser)
    assert cli_plot.run(parser.parse_args(["--results-dir", str(tmp_path), "--metric", "ttft"])) == 0
    assert (tmp_path / "attainment.png").read_bytes()[:8] == PNG_MAGIC
    assert "pull: 2 req/s" in capsys.readouterr().out
    argv = ["--results-dir", str(tmp_path), "--goodput", "ttft:6000"]
    assert cli_plot.run(parser.parse_args(argv)) == 0
    assert (tmp_path / "attainment_ttft6000.png").read_bytes()[:8] == PNG_MAGIC
    assert "pull: 4 req/s" in capsys.readouterr().out


def test_sweep_search_skips_rates_above_a_failure(tmp_path: Path) -> None:
    cfg = SweepConfig(
        modes=("pull", "colocated"), qps=(4.0, 1.0, 2.0), input_lens=(64,), output_lens=(5,), iterations=2,
        num_prompts=10, results_dir=tmp_path, server=ServerOptions("tiny"), goodput=("ttft:1000",),
        find_max_goodput=True,
    )  # fmt: skip
    assert [p[0] for p in cfg.points()] == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ascending when searching
    sweep = Sweep(cfg, log=lambda _: None)
    sweep._attained = {("pull", 64, 5): {1.0: [(1.0, 10), (0.8, 10)]}, ("colocated", 64, 5): {1.0: [(0.7, 10)]}}
    assert pooled_attainment([(1.0, 10), (0.8, 10)]) == pytest.approx(0.9)
    assert not sweep.is_past_max("pull", (2.0, 64, 5, 0))  # 90% at 1 req/s: sustained
    assert sweep.is_past_max("colocated", (2.0, 64, 5, 0))  # 70% at 1 req/s: stop climbing
    assert not sweep.is_past_max("colocated", (1.0, 64, 5, 1))  # the failing rate's own iterations still run
    with pytest.raises(ValueError, match="needs SLOs"):
        SweepConfig(("pull",), (1.0,), (64,), (5,), 1, 10, tmp_path, ServerOptions("tiny"), find_max_goodput=True)
    with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
        SweepConfig(("pull",), (1.0,), (64,), (5,), 1, 10, tmp_path, ServerOptions("tiny"), goodput=("ttft",))


def test_prompt_length_estimate() -> None:
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}) == 5  # token ids: exact
    assert estimate_prompt_tokens({"prompt": "abcdefgh"}) == 2  # UTF-8 bytes / 4
    assert estimate_prompt_tokens({"prompt": "abcde"}) == 2  # rounded up
    assert estimate_prompt_tokens({"prompt": "é" * 4}) == 2  # bytes, not characters
    assert estimate_prompt_tokens({"prompt": ["ab", "a" * 40]}) == 10  # a batch: its longest prompt
    assert estimate_prompt_tokens({"prompt": [[1, 2], [1, 2, 3]]}) == 3
    chat = {"messages": [{"role": "system", "content": "x" * 8}, {"role": "user", "content": [{"text": "y" * 8}]}]}
    assert estimate_prompt_tokens(chat) == 4
    assert estimate_prompt_tokens({"prompt": {"odd": 1}}) is None
    assert estimate_prompt_tokens({}) is None
