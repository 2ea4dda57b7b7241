"""The highest request rate each mode sustains within its SLOs, from sweep results, and its plot.

A rate is sustained when its SLO attainment (share of all requests, pooled over the iterations, within every
SLO) is at least the threshold, and so is every lower rate of the same mode and (input, output): the first
rate that falls below ends the climb, as the sweep's `--find-max-goodput` search does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.points import MODE_COLORS, Point, modes_in, per_request_ms

DEFAULT_THRESHOLD = 0.9  # SLO attainment a rate must reach to count as sustained


@dataclass(frozen=True)
class MaxGoodput:
    """One mode's result at one (input, output)."""

    mode: str
    input_len: int
    output_len: int
    max_qps: float | None  # highest sustained request rate (req/s); None when even the lowest rate missed
    goodput: float | None  # request goodput (req/s) measured at max_qps
    attainment: float | None  # SLO attainment (fraction) at max_qps
    first_failed_qps: float | None  # the rate that ended the climb; None when every rate run passed
    rates: list[tuple[float, float]]  # (qps, attainment) of every rate run, ascending


def score(result: dict[str, Any], slos_ms: dict[str, float]) -> dict[str, Any]:
    """A bench result's goodput keys recomputed from its per-request lists at other SLOs (ms), with the same
    rules as `calculate_metrics`: a failed request misses, a one-token request's TPOT counts as 0."""
    ttft, tpot, e2el = (per_request_ms(result, m) for m in ("ttft", "tpot", "e2el"))
    num_good = 0
    for i, first in enumerate(ttft):
        if first is None:
            continue  # failed
        values = {"ttft": first, "tpot": tpot[i] or 0.0, "e2el": e2el[i]}
        if all((values[name] or 0.0) <= slo for name, slo in slos_ms.items()):
            num_good += 1
    return {
        "goodput_slos_ms": dict(slos_ms),
        "request_goodput": num_good / result["duration"],
        "slo_attainment": num_good / len(ttft) if ttft else None,
    }


def rescore(points: Sequence[Point], slos_ms: dict[str, float]) -> list[Point]:
    """`points` with every result's goodput keys recomputed at `slos_ms` (the saved files are not changed)."""
    return [
        Point(p.mode, p.qps, p.input_len, p.output_len, [{**r, **score(r, slos_ms)} for r in p.results]) for p in points
    ]


def max_goodput(points: Sequence[Point], threshold: float = DEFAULT_THRESHOLD) -> list[MaxGoodput]:
    """Per mode and (input, output) with SLO results, the highest rate sustained at >= `threshold`."""
    groups: dict[tuple[str, int, int], list[Point]] = defaultdict(list)
    for p in points:
        if p.has_goodput and not math.isinf(p.qps):
            groups[(p.mode, p.input_len, p.output_len)].append(p)
    found = []
    for (mode, input_len, output_len), line in groups.items():
        line.sort(key=lambda p: p.qps)
        best: Point | None = None
        failed: float | None = None
        for p in line:
            if p.attainment() < threshold:
                failed = p.qps
                break
            best = p
        found.append(
            MaxGoodput(
                mode,
                input_len,
                output_len,
                best.qps if best else None,
                best.goodput() if best else None,
                best.attainment() if best else None,
                failed,
                [(p.qps, p.attainment()) for p in line],
            )
        )
    order = {m: i for i, m in enumerate(modes_in(points))}
    return sorted(found, key=lambda r: (r.input_len, r.output_len, order[r.mode]))


def max_goodput_lines(results: Sequence[MaxGoodput], threshold: float = DEFAULT_THRESHOLD) -> list[str]:
    """Lines like `in 64 out 8: push sustains 1 req/s (goodput 0.93 req/s, 95% within SLO; 2 req/s: 60%)`,
    and per (input, output) the ratio of each disaggregated mode's max rate to colocated's."""
    lines = [f"highest request rate with >= {threshold:.0%} of requests within every SLO:"]
    by_shape: dict[tuple[int, int], dict[str, MaxGoodput]] = defaultdict(dict)
    for r in results:
        by_shape[(r.input_len, r.output_len)][r.mode] = r
        if r.max_qps is None:
            text = f"none of the rates run (lowest {r.rates[0][0]:g} req/s: {r.rates[0][1]:.0%})"
        else:
            text = f"{r.max_qps:g} req/s (goodput {r.goodput:.2f} req/s, {r.attainment:.0%} within SLO; "
            if r.first_failed_qps is None:
                text += "the highest rate run)"
            else:
                text += f"{r.first_failed_qps:g} req/s: {dict(r.rates)[r.first_failed_qps]:.0%})"
        lines.append(f"  in {r.input_len} out {r.output_len} {r.mode}: {text}")
    for (input_len, output_len), modes in sorted(by_shape.items()):
        coloc = modes.get("colocated")
        coloc_qps = coloc.max_qps if coloc else None
        if not coloc_qps:
            continue
        for mode in ("push", "pull"):
            mode_qps = modes[mode].max_qps if mode in modes else None
            if mode_qps:
                ratio = mode_qps / coloc_qps
                lines.append(f"  in {input_len} out {output_len}: max rate {mode} / colocated {ratio:.2f}")
    return lines


def as_json(results: Sequence[MaxGoodput], threshold: float, slos_ms: dict[str, float] | None) -> dict[str, Any]:
    return {"threshold": threshold, "slos_ms": slos_ms, "results": [asdict(r) for r in results]}


def plot_attainment(points: Sequence[Point], out: Path, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """One panel per (input, output): x = request rate, y = SLO attainment (%), a line per mode, the
    threshold dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_slo = [p for p in points if p.has_goodput and not math.isinf(p.qps)]
    if not with_slo:
        raise ValueError("no result with goodput SLOs to plot")
    shapes = sorted({(p.input_len, p.output_len) for p in with_slo})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes) + 1.4, 4.0), squeeze=False, sharey=True)
    for ax, (input_len, output_len) in zip(axes[0], shapes, strict=True):
        for mode in modes_in(with_slo):
            line = sorted(
                (p for p in with_slo if p.mode == mode and (p.input_len, p.output_len) == (input_len, output_len)),
                key=lambda p: p.qps,
            )
            if line:
                xs, ys = [p.qps for p in line], [100 * p.attainment() for p in line]
                ax.plot(xs, ys, marker="o", color=MODE_COLORS.get(mode), label=mode)
        ax.axhline(100 * threshold, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"in {input_len}, out {output_len}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-3, 103)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment (% of requests)")
    axes[0][-1].legend()
    slos = next((r.get("goodput_slos_ms") for p in with_slo for r in p.results if r.get("goodput_slos_ms")), None)
    slo_text = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in (slos or {}).items())
    fig.suptitle(f"SLO attainment against request rate\n{slo_text}; dashed: {threshold:.0%}", fontsize="medium")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
