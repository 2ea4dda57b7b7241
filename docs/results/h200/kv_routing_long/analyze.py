"""The table of docs/benchmarks.md "KV-aware routing, long histories": one row per arm of every folder here.

python analyze.py      (reads */*_iter0.json.gz and, where present, */<arm>_router.log.gz)

Per arm: median and p99 TTFT, the median TTFT per turn (multi-turn folders), median TPOT, the pooled prefix hit
rate and KV bytes moved per request (the sweep's instance scrapes), the share of requests within TTFT <= 200 ms and
TPOT <= 10 ms (the goodput SLO used in the text), and how many requests the router ran whole on one instance vs
split through the prefill instance (from the router's request log lines: route=whole|split).
"""

import gzip
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent
SLO_TTFT_MS, SLO_TPOT_MS = 200.0, 10.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def routes(folder: Path, arm: str) -> dict[str, str]:
    path = folder / f"{arm}_router.log.gz"
    if not path.exists():
        return {}
    found = {}
    for line in gzip.open(path, "rt"):
        if m := re.search(r"request (\S+) mode=\S+ route=(\w+) ", line):
            found[m.group(1)] = m.group(2)
    return found


for path in sorted(HERE.glob("*/*_iter0.json.gz")):
    d = json.load(gzip.open(path))
    arm = d["mode"]  # <mode>-<routing>, as the sweep names the arm
    ttfts = [1e3 * t for t in d["ttfts"]]
    tpots = [
        1e3 * (lat - t) / (n - 1) for lat, t, n in zip(d["latencies"], d["ttfts"], d["output_lens"], strict=True) if n > 1
    ]
    good = sum(
        1
        for lat, t, n in zip(d["latencies"], d["ttfts"], d["output_lens"], strict=True)
        if 1e3 * t <= SLO_TTFT_MS and (n <= 1 or 1e3 * (lat - t) / (n - 1) <= SLO_TPOT_MS)
    )
    turns = " / ".join(f"{v:.0f}" for v in d.get("ttft_turn_medians_ms") or [])
    route = routes(path.parent, arm)
    whole = sum(1 for rid in d["request_ids"] if route.get(rid) == "whole")
    split = sum(1 for rid in d["request_ids"] if route.get(rid) == "split")
    kv = d.get("kv_bytes_per_request") or 0.0
    hit = d.get("prefix_hit_rate")
    print(
        f"{path.parent.name:17s} {arm:24s} n={len(ttfts):3d} TTFT med {statistics.median(ttfts):6.1f} p99 "
        f"{pct(ttfts, 0.99):6.0f} | turns {turns:29s} | TPOT {statistics.median(tpots):4.1f} | "
        f"hit {100 * hit if hit is not None else float('nan'):3.0f}% | KV/req {kv / 2**20:6.1f} MiB | "
        f"SLO {100 * good / len(ttfts):3.0f}% | whole/split {whole}/{split}"
    )
