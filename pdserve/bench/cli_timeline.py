"""`pdserve timeline`: per-request Gantt PNG from the servers' /timeline, one panel per mode, side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.error
from pathlib import Path

from pdserve.bench.phase_split import split_medians, split_table
from pdserve.bench.phases import PHASES, request_phases
from pdserve.bench.timeline import draw, fetch, join, load_saved, save


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", type=Path, help="saved timelines (sweep --save-timeline output)")
    parser.add_argument(
        "--fetch",
        action="append",
        default=[],
        metavar="MODE=PREFILL_URL,DECODE_URL[,ROUTER_URL]",
        help="read GET /timeline of a running prefill and decode instance, and of their router if given (its "
        "steps split router->P and pull's relay); repeat for push and pull",
    )
    parser.add_argument("--save-dir", type=Path, default=None, help="also save fetched timelines here")
    parser.add_argument("--match", default=None, help="only requests whose id contains this")
    parser.add_argument("--max-requests", type=int, default=24, help="rows per panel (the latest requests)")
    parser.add_argument("--out", type=Path, default=Path("timeline.png"), help="PNG to write")


def _fetch_panel(spec: str, save_dir: Path | None) -> tuple[str, list]:
    mode, sep, urls = spec.partition("=")
    parts = [u.strip() for u in urls.split(",")]
    if not sep or len(parts) not in (2, 3):
        raise ValueError(f"--fetch {spec!r} is not MODE=PREFILL_URL,DECODE_URL[,ROUTER_URL]")
    prefill, decode = fetch(parts[0]), fetch(parts[1])
    router = fetch(parts[2]) if len(parts) == 3 else []
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / f"timeline_{mode}.json"
        save(path, mode, prefill, decode, router)
        print(f"saved {path}")
    return mode, join(prefill, decode, router)


def run(args: argparse.Namespace) -> int:
    try:
        panels = [load_saved(f) for f in args.files]
        panels += [_fetch_panel(spec, args.save_dir) for spec in args.fetch]
    except (ValueError, OSError, urllib.error.URLError, json.JSONDecodeError) as e:
        print(f"pdserve timeline: {e}", file=sys.stderr)
        return 2
    if not panels:
        print("pdserve timeline: give saved timeline files or --fetch MODE=PREFILL_URL,DECODE_URL", file=sys.stderr)
        return 2
    order = {"push": 0, "pull": 1}
    panels.sort(key=lambda p: order.get(p[0], 2))
    if args.match:
        panels = [(mode, [t for t in tls if args.match in t.request_id]) for mode, tls in panels]
    for mode, tls in panels:
        print(f"{mode}: {len(tls)} requests")
        if mode in PHASES:  # the servers' phases (the client's two need the bench's clock: pdserve sweep prints them)
            per_phase: dict[str, list[float]] = {}
            for tl in tls:
                for label, seconds in request_phases(mode, tl, {}).items():
                    per_phase.setdefault(label, []).append(seconds)
            print("  median ms: " + " | ".join(f"{k} {1000 * statistics.median(v):.2f}" for k, v in per_phase.items()))
        split = split_medians(mode, [(tl, {}) for tl in tls])  # the router's and the instances' edge events
        if split:
            print(split_table(mode, split))
    out = draw(panels, args.out, args.max_requests)
    print(f"timeline written to {out}")
    return 0
