"""Sweep results -> plots and push/pull tables.

Per grid point (mode, qps, input length, output length) the iterations are pooled: the statistics below are
taken over every successful request of every iteration, from the per-request lists of the result JSONs.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
MODE_COLORS = {"push": "tab:orange", "pull": "tab:blue"}


@dataclass
class Point:
    """All runs of one grid point, pooled."""

    mode: str
    qps: float  # requests per second; inf = all at once
    input_len: int
    output_len: int
    results: list[dict[str, Any]] = field(default_factory=list)  # one bench result per iteration

    def values_ms(self, metric: str) -> list[float]:
        """Per-request values of `metric` in ms over every successful request of every iteration."""
        values: list[float] = []
        for r in self.results:
            for i, error in enumerate(r["errors"]):
                if error or not r["output_lens"][i]:
                    continue
                ttft, latency, num_out = r["ttfts"][i], r["latencies"][i], r["output_lens"][i]
                if metric == "ttft":
                    values.append(ttft * 1000)
                elif metric == "e2el":
                    values.append(latency * 1000)
                elif metric == "tpot":
                    if num_out > 1:
                        values.append((latency - ttft) / (num_out - 1) * 1000)
                elif metric == "itl":
                    values.extend(gap * 1000 for gap in r["itls"][i])
                else:
                    raise ValueError(f"metric {metric!r} is not one of {', '.join(METRIC_NAMES)}")
        return values

    def stat(self, metric: str, q: float = 50.0) -> float:
        values = self.values_ms(metric)
        return float(np.percentile(values, q)) if values else math.nan

    @property
    def num_failed(self) -> int:
        return sum(r["failed"] for r in self.results)

    @property
    def num_completed(self) -> int:
        return sum(r["completed"] for r in self.results)


def _qps(value: Any) -> float:
    return math.inf if str(value) == "inf" else float(value)


def load_results(paths: Iterable[Path | str]) -> list[Point]:
    """Group result JSONs (files, or folders of them) by grid point; ignores JSONs that are not results."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    points: dict[tuple, Point] = {}
    for f in files:
        data = json.loads(f.read_text())
        if not isinstance(data, dict) or "ttfts" not in data or "mode" not in data:
            continue
        key = (data["mode"], _qps(data.get("qps", data.get("request_rate"))), data["input_len"], data["output_len"])
        points.setdefault(key, Point(*key)).results.append(data)
    return sorted(points.values(), key=lambda p: (p.qps, p.input_len, p.output_len, p.mode))


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}"


def summary_rows(points: Sequence[Point], metrics: Sequence[str] = ("ttft", "tpot")) -> str:
    """A text table: one row per (qps, input, output); per metric push and pull medians (ms) and push/pull."""
    by_key: dict[tuple, dict[str, Point]] = defaultdict(dict)
    for p in points:
        by_key[(p.qps, p.input_len, p.output_len)][p.mode] = p
    header = ["qps", "input", "output"]
    for m in metrics:
        header += [f"push {METRIC_NAMES[m]}", f"pull {METRIC_NAMES[m]}", "push/pull"]
    header.append("failed")
    rows = [header]
    for (qps, input_len, output_len), modes in sorted(by_key.items()):
        row = [f"{qps:g}", str(input_len), str(output_len)]
        for m in metrics:
            push = modes["push"].stat(m) if "push" in modes else math.nan
            pull = modes["pull"].stat(m) if "pull" in modes else math.nan
            row += [_fmt(push), _fmt(pull), _ratio(push, pull)]
        row.append(str(sum(p.num_failed for p in modes.values())))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "median ms over all requests of all iterations\n" + "\n".join(lines)


def plot_metric(points: Sequence[Point], metric: str, out: Path, title: str | None = None) -> Path:
    """One panel per request rate; x = input length; per mode (and output length) the median, shaded to p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metric not in METRIC_NAMES:
        raise ValueError(f"metric {metric!r} is not one of {', '.join(METRIC_NAMES)}")
    if not points:
        raise ValueError("no results to plot")
    rates = sorted({p.qps for p in points})
    output_lens = sorted({p.output_len for p in points})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates) + 0.8, 3.8), squeeze=False, sharey=True)
    for ax, qps in zip(axes[0], rates, strict=True):
        for mode in sorted({p.mode for p in points}):
            for k, output_len in enumerate(output_lens):
                line = sorted(
                    (p for p in points if p.qps == qps and p.mode == mode and p.output_len == output_len),
                    key=lambda p: p.input_len,
                )
                if not line:
                    continue
                xs = [p.input_len for p in line]
                med = [p.stat(metric, 50) for p in line]
                p90 = [p.stat(metric, 90) for p in line]
                label = mode if len(output_lens) == 1 else f"{mode}, out {output_len}"
                color = MODE_COLORS.get(mode)
                ax.plot(xs, med, styles[k % len(styles)], marker="o", color=color, label=label)
                ax.fill_between(xs, med, p90, color=color, alpha=0.2)
        ax.set_title("all at once" if math.isinf(qps) else f"{qps:g} req/s")
        ax.set_xlabel("input length (tokens)")
        if len({p.input_len for p in points}) > 2:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"{METRIC_NAMES[metric]} (ms): median, shaded to p90")
    axes[0][-1].legend()
    fig.suptitle(title or f"{METRIC_NAMES[metric]}: push vs pull")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def ratio_lines(points: Sequence[Point], metric: str) -> list[str]:
    """Lines like `qps 1 in 512 out 64: median TTFT push 123.4 ms, pull 150.2 ms, push/pull 0.82`."""
    by_key: dict[tuple, dict[str, Point]] = defaultdict(dict)
    for p in points:
        by_key[(p.qps, p.input_len, p.output_len)][p.mode] = p
    lines = []
    for (qps, input_len, output_len), modes in sorted(by_key.items()):
        if "push" in modes and "pull" in modes:
            push, pull = modes["push"].stat(metric), modes["pull"].stat(metric)
            lines.append(
                f"qps {qps:g} in {input_len} out {output_len}: median {METRIC_NAMES[metric]} push {_fmt(push)} ms, "
                f"pull {_fmt(pull)} ms, push/pull {_ratio(push, pull)}"
            )
    return lines
