"""Sweep results pooled by grid point: load the result JSONs, and a Point's per-request values and statistics.

Per grid point (mode, qps, input length, output length) the iterations are pooled: the statistics are taken
over every successful request of every iteration, from the per-request lists of the result JSONs. Over the run
(steady state), each iteration's requests are split into quarters by send order and quarter k of every
iteration is pooled, so a point's quarter medians say whether a metric drifts as the run goes on.

Lives apart from the plots and tables (plot.py, goodput.py) because they all read the same pooled Points and
none of this needs matplotlib.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.metrics import NUM_QUARTERS, drift_ratio, split_quarters

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
PER_REQUEST_METRICS = ("ttft", "tpot", "e2el")  # one value per request (ITL has many), so plottable over the run
MODE_COLORS = {"push": "tab:orange", "pull": "tab:blue", "colocated": "tab:green"}
MODE_ORDER = ("push", "pull", "colocated")  # column order in tables; other modes follow alphabetically


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
        if metric not in METRIC_NAMES:
            raise ValueError(f"metric {metric!r} is not one of {', '.join(METRIC_NAMES)}")
        values: list[float] = []
        for r in self.results:
            if metric == "itl":
                for i, error in enumerate(r["errors"]):
                    if not error and r["output_lens"][i]:
                        values.extend(gap * 1000 for gap in r["itls"][i])
            else:
                values.extend(v for v in per_request_ms(r, metric) if v is not None)
        return values

    def quarter_medians(self, metric: str = "ttft") -> list[float]:
        """Median (ms) of each quarter of the run by send order, iterations pooled quarter by quarter; nan
        for a quarter without a successful request."""
        pooled: list[list[float]] = [[] for _ in range(NUM_QUARTERS)]
        for r in self.results:
            for k, quarter in enumerate(split_quarters(per_request_ms(r, metric))):
                pooled[k].extend(v for v in quarter if v is not None)
        return [float(np.median(q)) if q else math.nan for q in pooled]

    def drift(self, metric: str = "ttft") -> float:
        """Last quarter's median / first quarter's (1 = steady); nan when undefined."""
        ratio = drift_ratio([None if math.isnan(q) else q for q in self.quarter_medians(metric)])
        return math.nan if ratio is None else ratio

    def stat(self, metric: str, q: float = 50.0) -> float:
        values = self.values_ms(metric)
        return float(np.percentile(values, q)) if values else math.nan

    @property
    def has_goodput(self) -> bool:
        return any(r.get("slo_attainment") is not None for r in self.results)

    def attainment(self) -> float:
        """SLO attainment pooled over the iterations (fraction of all requests within every SLO); nan without SLOs."""
        runs = [(r["slo_attainment"], len(r["ttfts"])) for r in self.results if r.get("slo_attainment") is not None]
        total = sum(n for _, n in runs)
        return sum(a * n for a, n in runs) / total if total else math.nan

    def goodput(self) -> float:
        """Mean request goodput (req/s) over the iterations; nan without SLOs."""
        values = [r["request_goodput"] for r in self.results if r.get("request_goodput") is not None]
        return float(np.mean(values)) if values else math.nan

    def kv_bytes_per_request(self) -> float:
        """KV bytes the decode side received per completed request, pooled over the iterations; nan when the
        results carry no instance counts (bench/instances.py; colocated arms count 0)."""
        runs = [
            (r["kv_bytes_per_request"], r["completed"])
            for r in self.results
            if r.get("kv_bytes_per_request") is not None
        ]
        total = sum(n for _, n in runs)
        return sum(v * n for v, n in runs) / total if total else math.nan

    def prefix_hit_rate(self) -> float:
        """Prefix-cache hit tokens / prompt tokens admitted, every instance pooled, averaged over the
        iterations by their completed requests; nan without instance counts."""
        runs = [(r["prefix_hit_rate"], r["completed"]) for r in self.results if r.get("prefix_hit_rate") is not None]
        total = sum(n for _, n in runs)
        return sum(v * n for v, n in runs) / total if total else math.nan

    def turn_medians_ms(self) -> list[float]:
        """Median TTFT (ms) of each conversation turn, iterations pooled (multi-turn datasets); [] when every
        request is turn 0 (other datasets), nan for a turn without a successful request."""
        by_turn: dict[int, list[float]] = {}
        for r in self.results:
            if not r.get("turns"):
                continue
            for turn, value in zip(r["turns"], per_request_ms(r, "ttft"), strict=True):
                by_turn.setdefault(turn, [])
                if value is not None:
                    by_turn[turn].append(value)
        if not by_turn or max(by_turn) == 0:
            return []
        return [float(np.median(by_turn[t])) if by_turn.get(t) else math.nan for t in range(max(by_turn) + 1)]

    @property
    def num_failed(self) -> int:
        return sum(r["failed"] for r in self.results)

    @property
    def num_completed(self) -> int:
        return sum(r["completed"] for r in self.results)


def per_request_ms(result: dict[str, Any], metric: str) -> list[float | None]:
    """One value (ms) per request of one bench result, in send order; None for a failed request (and for
    the TPOT of a one-token request). `metric` is one of PER_REQUEST_METRICS."""
    if metric not in PER_REQUEST_METRICS:
        raise ValueError(f"metric {metric!r} has no single value per request; use one of {PER_REQUEST_METRICS}")
    values: list[float | None] = []
    for error, ttft, latency, num_out in zip(
        result["errors"], result["ttfts"], result["latencies"], result["output_lens"], strict=True
    ):
        if error or not num_out:
            values.append(None)
        elif metric == "ttft":
            values.append(ttft * 1000)
        elif metric == "e2el":
            values.append(latency * 1000)
        else:
            values.append((latency - ttft) / (num_out - 1) * 1000 if num_out > 1 else None)
    return values


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


def modes_in(points: Sequence[Point]) -> list[str]:
    """The modes of `points` in table order: push, pull, colocated, then any other alphabetically."""
    found = {p.mode for p in points}
    return [m for m in MODE_ORDER if m in found] + sorted(found - set(MODE_ORDER))
