"""TTFT of the requests each router ran whole on a decode instance vs split through the prefill instance.

python analyze_routes.py   (in this folder: reads <arm>_router.log and <arm>_qps4_in512_out64_iter0.json)
"""

import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent
for arm in ("pull-least-loaded", "pull-kv-aware", "push-least-loaded", "push-kv-aware"):
    route = {}
    for line in (HERE / f"{arm}_router.log").read_text().splitlines():
        m = re.search(r"request (\S+) mode=\S+ route=(\w+) ", line)
        if m:
            route[m.group(1)] = m.group(2)
    d = json.loads((HERE / f"{arm}_qps4_in512_out64_iter0.json").read_text())
    by: dict[str, list[float]] = {"whole": [], "split": []}
    for rid, ttft in zip(d["request_ids"], d["ttfts"], strict=True):
        if rid in route:
            by[route[rid]].append(1e3 * ttft)
    for kind, ts in by.items():
        if ts:
            ts.sort()
            print(f"{arm:18s} {kind:5s} n={len(ts):3d} median {statistics.median(ts):6.1f} ms  p90 {ts[int(0.9 * len(ts))]:7.1f} ms")
