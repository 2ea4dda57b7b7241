"""Aggregate per-request measurements into the result JSON of `vllm bench serve`, same names, same math.

- TPOT of a request = (latency - TTFT) / (output tokens - 1), only for requests with more than one token;
  for goodput a one-token request counts as TPOT 0.
- Goodput (given SLOs in ms for any of ttft, tpot, e2el): `request_goodput` = successful requests meeting every
  SLO / duration, as vLLM; pdserve adds `slo_attainment` = those requests / all requests sent (a failed request
  misses its SLO), a fraction in [0, 1]. Both None without SLOs.
- ITL statistics pool every gap of every successful request.
- Statistics are numpy mean / median / std / percentile (linear interpolation), reported in ms, of the
  successful requests; all zero when none succeeded.
- Throughputs divide by the wall time of the whole run (`duration`).
- Per-request lists (`input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`, `errors`) keep every request
  in send order; a failed request has output_len 0. pdserve adds `users` and `turns`: who sent each request
  and its place in that user's conversation (multiturn; elsewhere each request is user i's turn 0).
- Steady state (pdserve's addition; vLLM's keys are unchanged): the requests are split by send order (= arrival
  order) into four quarters of the run, sizes differing by at most one; `ttft_quarter_medians_ms` and
  `tpot_quarter_medians_ms` are each quarter's median over its successful requests (None for a quarter
  without one), and `ttft_drift` / `tpot_drift` are last quarter / first quarter (None when undefined).
  Warm-up requests are never among the outputs, so they are in none of these figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from pdserve.bench.client import RequestOutput

DEFAULT_PERCENTILES = (90.0, 99.0)
METRICS = (  # (key, label, header) in the order of the summary table
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
NUM_QUARTERS = 4
T = TypeVar("T")


def split_quarters(items: Sequence[T]) -> list[list[T]]:
    """items in send order -> NUM_QUARTERS consecutive runs, sizes differing by at most one (earlier ones larger)."""
    size, extra = divmod(len(items), NUM_QUARTERS)
    quarters, start = [], 0
    for k in range(NUM_QUARTERS):
        end = start + size + (1 if k < extra else 0)
        quarters.append(list(items[start:end]))
        start = end
    return quarters


def quarter_medians_ms(values: Sequence[float | None], scale: float = 1000.0) -> list[float | None]:
    """One value per request in send order (None: no value, e.g. a failed request) -> the median of each
    quarter of the run, times `scale` (seconds -> ms by default); None for a quarter without a value."""
    medians: list[float | None] = []
    for quarter in split_quarters(values):
        present = [v for v in quarter if v is not None]
        medians.append(float(np.median(present)) * scale if present else None)
    return medians


def drift_ratio(quarter_medians: Sequence[float | None]) -> float | None:
    """Last quarter's median / first quarter's: 1 = no drift; None when either is missing or the first is 0."""
    first, last = quarter_medians[0], quarter_medians[-1]
    if first is None or last is None or first <= 0:
        return None
    return last / first


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO {pair!r} is not NAME:MILLISECONDS")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO name {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {name} must be >= 0 ms, got {value}")
    return slos


def percentile_key(p: float) -> str:
    """90.0 -> "p90", 99.9 -> "p99.9" (vLLM's spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _stats(values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, std and percentiles of values in seconds, returned in ms."""
    arr = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    stats = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(arr, p))
    return stats


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The result dict of one run: the aggregates first, then per-request lists, then the ms statistics."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [gap for o in ok for gap in o.itl]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    all_tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in ok]

    num_good = 0
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            if all(per_request[name][i] <= slo_ms / 1000.0 for name, slo_ms in goodput.items()):
                num_good += 1

    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": num_good / duration if goodput else None,
        "slo_attainment": num_good / len(outputs) if goodput and outputs else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "request_ids": [o.request_id for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "users": [o.user for o in outputs],
        "turns": [o.turn for o in outputs],
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            result[f"{stat}_{key}_ms"] = value
    # seconds, every request in send order, None where the metric has no value
    by_arrival: dict[str, list[float | None]] = {
        "ttft": [o.ttft if o.success else None for o in outputs],
        "tpot": [
            (o.latency - o.ttft) / (o.output_tokens - 1) if o.success and o.output_tokens > 1 else None for o in outputs
        ],
    }
    for key, per_request_s in by_arrival.items():
        quarters = quarter_medians_ms(per_request_s)
        result[f"{key}_quarter_medians_ms"] = quarters
        result[f"{key}_drift"] = drift_ratio(quarters)
    return result


def format_quarters(quarters: Sequence[float | None]) -> str:
    """[36.2, 34.0, None, 92.5] -> "36.2 / 34.0 / - / 92.5"."""
    return " / ".join("-" if q is None else f"{q:.1f}" for q in quarters)


def format_summary(result: dict[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> str:
    """The end-of-run table, laid out like `vllm bench serve`'s."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    row = "{:<44} {:<14}"
    lines.append(row.format("Successful requests:", result["completed"]))
    lines.append(row.format("Failed requests:", result["failed"]))
    for label, key in (("Maximum request concurrency:", "max_concurrency"), ("Request rate (RPS):", "request_rate")):
        if result.get(key) is not None:
            lines.append(row.format(label, result[key]))
    lines.append(row.format("Benchmark duration (s):", f"{result['duration']:.2f}"))
    lines.append(row.format("Total input tokens:", result["total_input_tokens"]))
    lines.append(row.format("Total generated tokens:", result["total_output_tokens"]))
    lines.append(row.format("Request throughput (req/s):", f"{result['request_throughput']:.2f}"))
    if result.get("request_goodput") is not None:
        lines.append(row.format("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    if result.get("slo_attainment") is not None:
        lines.append(row.format("SLO attainment (%):", f"{100 * result['slo_attainment']:.1f}"))
    lines.append(row.format("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    lines.append(row.format("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"))
    for key, label, header in METRICS:
        lines.append(f"{header:-^60}")
        lines.append(row.format(f"Mean {label} (ms):", f"{result[f'mean_{key}_ms']:.2f}"))
        lines.append(row.format(f"Median {label} (ms):", f"{result[f'median_{key}_ms']:.2f}"))
        for p in percentiles:
            pk = percentile_key(p)
            lines.append(row.format(f"{pk.upper()} {label} (ms):", f"{result[f'{pk}_{key}_ms']:.2f}"))
    if "ttft_quarter_medians_ms" in result:
        lines.append("{:-^60}".format("Over the run (median per quarter, by arrival)"))
        for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
            drift = result.get(f"{key}_drift")
            lines.append(row.format(f"{label} per quarter (ms):", format_quarters(result[f"{key}_quarter_medians_ms"])))
            lines.append(row.format(f"{label} drift (last/first quarter):", "-" if drift is None else f"{drift:.2f}"))
    lines.append("=" * 60)
    errors = [e for e in result.get("errors", []) if e]
    for i, err in enumerate(errors[:5]):
        lines.append(f"error {i}: {err.strip().splitlines()[-1] if err.strip() else err}")
    return "\n".join(lines)
