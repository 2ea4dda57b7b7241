"""`pdserve plot`: a sweep's result JSONs -> a PNG per metric and one over the run, the push/pull ratio per
point, and each point's median per quarter of the run (steady state: does the metric drift?); with goodput
SLOs in the results, SLO attainment against request rate per mode and the highest sustained rate; with instance
counts or a multi-turn dataset, each arm's prefix hit rate, KV moved per request and TTFT per turn (cache.png)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pdserve.bench.plot import drift_lines, plot_metric, plot_over_run, ratio_lines, summary_rows
from pdserve.bench.plot_cache import cache_lines, plot_cache
from pdserve.bench.points import METRIC_NAMES, PER_REQUEST_METRICS, load_results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", type=Path, required=True, help="folder of sweep result JSONs")
    parser.add_argument("--metric", choices=list(METRIC_NAMES), default="ttft", help="latency metric to plot")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG path (default: <results-dir>/<metric>.png); the metric against request index goes beside it "
        "as <name>_over_run.png (not for itl, which has many values per request)",
    )
    parser.add_argument("--title", default=None, help="figure title (default: derived)")
    parser.add_argument(
        "--goodput-threshold",
        type=float,
        default=90.0,
        metavar="PERCENT",
        help="when the results carry goodput SLOs (sweep --goodput, or --goodput here): also print the summary "
        "table with goodput, write attainment.png beside the metric's plot (attainment_<slos>.png with --goodput; "
        "SLO attainment against request rate per mode, this threshold dashed) and print the highest rate each "
        "mode sustains at >= this percent (default 90)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="SLO:MS",
        help="score the saved results at these latency targets instead of the ones they were run with (e.g. "
        "ttft:2000 tpot:200; any of ttft, tpot, e2el), from their per-request lists; the files are not changed",
    )


def run(args: argparse.Namespace) -> int:
    points = load_results([args.results_dir])
    if not points:
        print(f"pdserve plot: no sweep results in {args.results_dir}", file=sys.stderr)
        return 1
    if args.goodput:
        from pdserve.bench.goodput import rescore
        from pdserve.bench.metrics import parse_goodput

        try:
            points = rescore(points, parse_goodput(args.goodput))
        except ValueError as e:
            print(f"pdserve plot: {e}", file=sys.stderr)
            return 2
    out = args.out or args.results_dir / f"{args.metric}.png"
    plot_metric(points, args.metric, out, args.title)
    for line in ratio_lines(points, args.metric):
        print(line)
    print(f"plot written to {out}")
    if args.metric in PER_REQUEST_METRICS:
        for line in drift_lines(points, args.metric):
            print(line)
        over_run = plot_over_run(points, args.metric, out.with_name(f"{out.stem}_over_run.png"))
        print(f"plot over the run written to {over_run}")
    lines = cache_lines(points)
    if lines:
        for line in lines:
            print(line)
        print(f"cache plot written to {plot_cache(points, out.with_name('cache.png'), args.title)}")
    if any(p.has_goodput for p in points):
        print(summary_rows(points))
        from pdserve.bench.goodput import max_goodput, max_goodput_lines, plot_attainment

        threshold = args.goodput_threshold / 100.0
        for line in max_goodput_lines(max_goodput(points, threshold), threshold):
            print(line)
        if any(not math.isinf(p.qps) for p in points if p.has_goodput):
            name = "attainment.png" if not args.goodput else f"attainment_{'_'.join(args.goodput).replace(':', '')}.png"
            path = plot_attainment(points, out.with_name(name), threshold)
            print(f"attainment plot written to {path}")
    return 0
