"""Sweep results -> plots and tables of the modes side by side (push, pull, colocated).

The points are the pooled grid points of points.py (load_results); here they become a text table, a PNG per
metric, a PNG over the run (steady state) and one-line summaries (push/pull ratios, drift per quarter).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.bench.metrics import split_quarters
from pdserve.bench.points import METRIC_NAMES, MODE_COLORS, Point, modes_in, per_request_ms


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _fmt2(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}"


def _fmt_quarters(quarters: Sequence[float]) -> str:
    """[36.2, 34.0, nan, 1234.5] -> "36/34/-/1234" (ms; one decimal below 10 ms)."""
    return "/".join("-" if math.isnan(q) else f"{q:.1f}" if q < 10 else f"{q:.0f}" for q in quarters)


def summary_rows(
    points: Sequence[Point], metrics: Sequence[str] = ("ttft", "tpot"), drift_metric: str | None = "ttft"
) -> str:
    """A text table: one row per (qps, input, output); per metric each mode's median (ms) and push/pull (when
    both ran); with SLOs each mode's goodput (req/s) and SLO attainment (%); then, per mode, `drift_metric`'s
    median per quarter of the run and its drift (last / first quarter)."""
    by_key: dict[tuple, dict[str, Point]] = defaultdict(dict)
    for p in points:
        by_key[(p.qps, p.input_len, p.output_len)][p.mode] = p
    modes_present = modes_in(points)
    both = "push" in modes_present and "pull" in modes_present
    with_goodput = any(p.has_goodput for p in points)
    header = ["qps", "input", "output"]
    for m in metrics:
        header += [f"{mode} {METRIC_NAMES[m]}" for mode in modes_present] + (["push/pull"] if both else [])
    if with_goodput:
        for mode in modes_present:
            header += [f"{mode} goodput", f"{mode} SLO%"]
    if drift_metric:
        for mode in modes_present:
            header += [f"{mode} {METRIC_NAMES[drift_metric]} q1/q2/q3/q4", f"{mode} drift"]
    header.append("failed")
    rows = [header]
    for (qps, input_len, output_len), modes in sorted(by_key.items()):
        row = [f"{qps:g}", str(input_len), str(output_len)]
        for m in metrics:
            values = {mode: modes[mode].stat(m) if mode in modes else math.nan for mode in modes_present}
            row += [_fmt(values[mode]) for mode in modes_present]
            if both:
                row.append(_ratio(values["push"], values["pull"]))
        if with_goodput:
            for mode in modes_present:
                got = modes.get(mode)
                row += [_fmt2(got.goodput()), _fmt(100 * got.attainment())] if got else ["-", "-"]
        if drift_metric:
            for mode in modes_present:
                if mode in modes:
                    drift = modes[mode].drift(drift_metric)
                    row += [_fmt_quarters(modes[mode].quarter_medians(drift_metric)), _ratio(drift, 1.0)]
                else:
                    row += ["-", "-"]
        row.append(str(sum(p.num_failed for p in modes.values())))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    note = "median ms over all requests of all iterations"
    if with_goodput:
        note += "; goodput: req/s within every SLO (mean of iterations), SLO%: share of all requests within them"
    if drift_metric:
        note += "; q1..q4: median per quarter of the run by arrival, drift = q4/q1"
    return note + "\n" + "\n".join(lines)


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
        for mode in modes_in(points):
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
    fig.suptitle(title or f"{METRIC_NAMES[metric]}: {' vs '.join(modes_in(points))}")
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


def plot_over_run(points: Sequence[Point], metric: str, out: Path, title: str | None = None) -> Path:
    """One panel per grid point (qps, input, output): x = request index in arrival order, y = the metric of
    each successful request (ms), per mode, every iteration; a step line marks each quarter's median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not points:
        raise ValueError("no results to plot")
    per_request_ms(points[0].results[0], metric)  # refuses ITL before drawing anything
    keys = sorted({(p.qps, p.input_len, p.output_len) for p in points})
    ncols = min(len(keys), 3)
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for p in sorted((p for p in points if (p.qps, p.input_len, p.output_len) == key), key=lambda p: p.mode):
            color = MODE_COLORS.get(p.mode)
            num = 0
            for r in p.results:
                values = per_request_ms(r, metric)
                xs = [i for i, v in enumerate(values) if v is not None]
                ax.scatter(xs, [values[i] for i in xs], s=6, alpha=0.5, color=color)
                num = max(num, len(values))
            bounds = [0] + list(np.cumsum([len(q) for q in split_quarters(range(num))]))
            medians = p.quarter_medians(metric)
            label = f"{p.mode} (drift {_ratio(p.drift(metric), 1.0)}, {p.num_failed} failed)"
            for k, med in enumerate(medians):
                ax.hlines(med, bounds[k], bounds[k + 1], color=color, linewidth=2, label=label if k == 0 else None)
        qps, input_len, output_len = key
        rate = "all at once" if math.isinf(qps) else f"{qps:g} req/s"
        ax.set_title(f"{rate}, in {input_len}, out {output_len}")
        ax.set_xlabel("request index (arrival order)")
        ax.set_ylabel(f"{METRIC_NAMES[metric]} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.suptitle(title or f"{METRIC_NAMES[metric]} over the run: dots per request, lines per-quarter medians")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def drift_lines(points: Sequence[Point], metric: str) -> list[str]:
    """Lines like `qps 8 in 4096 out 128 push: TTFT per quarter 36/34/134/92 ms, drift 2.56`."""
    return [
        f"qps {p.qps:g} in {p.input_len} out {p.output_len} {p.mode}: {METRIC_NAMES[metric]} per quarter "
        f"{_fmt_quarters(p.quarter_medians(metric))} ms, drift {_ratio(p.drift(metric), 1.0)}"
        for p in points
    ]
