"""`pdserve plot` and `pdserve timeline` write valid PNGs from synthetic results and timelines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench import cli_plot, cli_timeline
from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import calculate_metrics
from pdserve.bench.plot import summary_rows
from pdserve.bench.points import load_results
from pdserve.bench.sweep_config import point_stem
from pdserve.bench.timeline import join

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR width, height


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _write_sweep(root: Path) -> None:
    """push TTFT = 0.8 x pull TTFT at every point, so the printed ratio is known."""
    for mode, scale in (("push", 0.8), ("pull", 1.0)):
        for qps in (1.0, float("inf")):
            for input_len in (128, 512):
                for it in range(2):
                    base = input_len / 1000 * scale
                    outs = [
                        RequestOutput(f"{mode}-{i}", True, input_len, 8, base, [0.01] * 7, base + 0.07)
                        for i in range(4)
                    ]
                    result = calculate_metrics(outs, duration=1.0)
                    result.update(mode=mode, qps="inf" if qps == float("inf") else qps, iteration=it)
                    result.update(input_len=input_len, output_len=8)
                    (root / f"{point_stem(mode, qps, input_len, 8, it)}.json").write_text(json.dumps(result))


def test_plot_writes_png_and_prints_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_sweep(tmp_path)
    (tmp_path / "timeline_push.json").write_text("{}")  # not a result: ignored
    out = tmp_path / "plots" / "ttft.png"
    assert cli_plot.run(_parse(cli_plot, ["--results-dir", str(tmp_path), "--metric", "ttft", "--out", str(out)])) == 0
    width, height = _png_size(out)
    assert width > 400 and height > 200
    printed = capsys.readouterr().out
    assert printed.count("push/pull 0.80") == 4  # 2 rates x 2 input lengths
    assert cli_plot.run(_parse(cli_plot, ["--results-dir", str(tmp_path), "--metric", "tpot"])) == 0
    _png_size(tmp_path / "tpot.png")
    table = summary_rows(load_results([tmp_path]))
    assert "push TTFT" in table and table.count("0.80") == 4


def _entries(mode: str, num: int, t0: float) -> tuple[list[dict], list[dict]]:
    prefill, decode = [], []
    for i in range(num):
        a = t0 + 0.05 * i
        p = {"arrival": a, "prefill_start": a + 0.01, "prefill_end": a + 0.05}
        d = {"arrival": a + 0.001, "kv_received": a + 0.07, "first_token": a + 0.08, "finished": a + 0.2}
        if mode == "push":
            d["registration_sent"] = a + 0.005
            p["registration_received"] = a + 0.006
            p.update(transfer_posted=a + 0.05, transfer_done=a + 0.065)
        else:
            d.update(transfer_posted=a + 0.055, transfer_done=a + 0.07)
        prefill.append({"request_id": f"{mode}-0-{i}", "role": "prefill", "events": p})
        decode.append({"request_id": f"cmpl-{mode}-0-{i}", "role": "decode", "events": d})
    return prefill, decode


def test_join_by_request_id() -> None:
    prefill, decode = _entries("push", 3, 1000.0)
    timelines = join(prefill, decode)
    assert [t.request_id for t in timelines] == ["push-0-0", "push-0-1", "push-0-2"]
    assert timelines[0].event("P", "registration_received") == pytest.approx(1000.006)
    assert timelines[0].event("D", "first_token") == pytest.approx(1000.08)


def test_timeline_writes_png_from_saved_files(tmp_path: Path) -> None:
    files = []
    for mode in ("pull", "push"):
        prefill, decode = _entries(mode, 6, 2000.0)
        path = tmp_path / f"timeline_{mode}.json"
        path.write_text(json.dumps({"mode": mode, "prefill": prefill, "decode": decode}))
        files.append(str(path))
    out = tmp_path / "timeline.png"
    assert cli_timeline.run(_parse(cli_timeline, [*files, "--out", str(out)])) == 0
    width, height = _png_size(out)
    assert width > 1000 and height > 100  # two panels side by side


def test_timeline_without_input_fails_cleanly(tmp_path: Path) -> None:
    assert cli_timeline.run(_parse(cli_timeline, ["--out", str(tmp_path / "x.png")])) == 2
    assert not (tmp_path / "x.png").exists()


def test_plot_reports_the_caches_per_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Multi-turn results with instance counts: hit rate and KV moved pooled over iterations by completed
    requests, the TTFT median per turn; a random-prompt arm (every request turn 0) has no turn line."""
    arms = {"push-kv-aware": (0.7, 8 << 20, 0.05), "push-least-loaded": (0.5, 300 << 20, 0.10)}
    for arm, (hit, moved, step) in arms.items():
        for it in range(2):
            outs = [
                RequestOutput(
                    f"{arm}-{it}-{u}-{t}",
                    True,
                    2048,
                    8,
                    step * (t + 1),
                    [0.01] * 7,
                    step * (t + 1) + 0.07,
                    user=u,
                    turn=t,
                )
                for u in range(3)
                for t in range(3)
            ]
            result = calculate_metrics(outs, duration=1.0)
            result.update(mode=arm, qps=1.0, iteration=it, input_len=2048, output_len=8)
            result.update(kv_bytes_per_request=moved * (1 + it), prefix_hit_rate=hit)  # iteration 1 moves twice as much
            (tmp_path / f"{point_stem(arm, 1.0, 2048, 8, it)}.json").write_text(json.dumps(result))
    outs = [RequestOutput(f"r{i}", True, 512, 8, 0.02, [0.01] * 7, 0.09) for i in range(4)]
    result = calculate_metrics(outs, duration=1.0)
    result.update(mode="push", qps=4.0, iteration=0, input_len=512, output_len=8, kv_bytes_per_request=float(1 << 20))
    (tmp_path / f"{point_stem('push', 4.0, 512, 8, 0)}.json").write_text(json.dumps(result))
    assert cli_plot.run(_parse(cli_plot, ["--results-dir", str(tmp_path)])) == 0
    printed = capsys.readouterr().out
    assert "push-kv-aware: prefix hit 70%, KV moved 12.0 MiB/request, TTFT per turn 50/100/150 ms" in printed
    assert "push-least-loaded: prefix hit 50%, KV moved 450.0 MiB/request, TTFT per turn 100/200/300 ms" in printed
    assert "in 512 out 8 push: prefix hit -, KV moved 1.0 MiB/request\n" in printed
    width, _ = _png_size(tmp_path / "cache.png")
    assert width > 800  # three panels
