"""`pdserve plot`: a sweep's result JSONs -> a PNG per metric, and the push/pull ratio per point."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.bench.plot import METRIC_NAMES, load_results, plot_metric, ratio_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", type=Path, required=True, help="folder of sweep result JSONs")
    parser.add_argument("--metric", choices=list(METRIC_NAMES), default="ttft", help="latency metric to plot")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: <results-dir>/<metric>.png)")
    parser.add_argument("--title", default=None, help="figure title (default: derived)")


def run(args: argparse.Namespace) -> int:
    points = load_results([args.results_dir])
    if not points:
        print(f"pdserve plot: no sweep results in {args.results_dir}", file=sys.stderr)
        return 1
    out = plot_metric(points, args.metric, args.out or args.results_dir / f"{args.metric}.png", args.title)
    for line in ratio_lines(points, args.metric):
        print(line)
    print(f"plot written to {out}")
    return 0
