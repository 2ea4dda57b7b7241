"""The table of docs/benchmarks.md "Multi-turn on the CPU at a rate it serves": one row per arm, iterations pooled.

python analyze.py      (reads */*_iter*.json.gz and */<arm>_router.log.gz)

A copy of docs/results/h200/kv_routing_long/analyze.py adapted to `--iterations 2 --interleave` runs: per arm
(<mode>-<routing>), pooled over its iterations: median and p99 TTFT, the median TTFT per turn, median TPOT, the
pooled prefix hit rate over every instance (hit tokens / prompt tokens admitted) and KV bytes received by the
decode instances per request (the sweep's instance scrapes), how many requests the router ran whole on one instance
vs split through the prefill instance (router log lines: route=whole|split) with the median TTFT of each, the
requests per instance, and each iteration's drift (TTFT median of its last quarter / first quarter by arrival).
Then each iteration's phase medians (the sweep's "where the time goes", split requests only for push).
"""

import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


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


def prefills(folder: Path, arm: str, route: dict[str, str]) -> str:
    """From timeline_<arm>.json.gz: median ms of arrival -> prefill_start (wait) and prefill_start -> first_token
    (prefill), for P's legs and for the turns run whole on one instance (D, or a colocated instance)."""
    path = folder / f"timeline_{arm}.json.gz"
    if not path.exists():
        return ""
    timeline = json.load(gzip.open(path))
    out = []
    for role, kind in (("prefill", "split"), ("decode", "whole"), ("both", "whole")):
        waits, steps = [], []
        for entry in timeline.get(role) or []:
            ev, rid = entry["events"], entry.get("client_request_id") or ""
            if "warmup" in rid or route.get(rid, "whole") != kind:
                continue
            if "prefill_start" not in ev or "first_token" not in ev:
                continue
            waits.append(1e3 * (ev["prefill_start"] - ev["arrival"]))
            steps.append(1e3 * (ev["first_token"] - ev["prefill_start"]))
        if steps:
            out.append(f"{role} ({kind}, n={len(steps)}): wait {med(waits)} ms, prefill -> first token {med(steps)} ms")
    return f"{arm:24s} " + "; ".join(out)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f}" if xs else "-"


runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
for path in sorted(HERE.glob("*/*_iter*.json.gz")):
    d = json.load(gzip.open(path))
    runs[(path.parent.name, d["mode"])].append(d)

phase_lines, prefill_lines = [], []
for (folder, arm), ds in sorted(runs.items()):
    route = routes(HERE / folder, arm)
    ttfts, tpots, by_turn, by_route = [], [], defaultdict(list), defaultdict(list)
    prompt = hit = kv_in = done = 0
    per_instance: dict[str, int] = defaultdict(int)
    drifts = []
    for d in sorted(ds, key=lambda d: d["iteration"]):
        for t, lat, n, turn, rid in zip(
            d["ttfts"], d["latencies"], d["output_lens"], d["turns"], d["request_ids"], strict=True
        ):
            ttfts.append(1e3 * t)
            by_turn[turn].append(1e3 * t)
            by_route[route.get(rid, "?")].append(1e3 * t)
            if n > 1:
                tpots.append(1e3 * (lat - t) / (n - 1))
        for inst in d["instances"]:
            prompt += inst["prompt_tokens"]
            hit += inst["prefix_hit_tokens"]
            kv_in += inst["kv_received_bytes"]
            per_instance[f"{inst['role'][0].upper()}{inst['url'].rsplit(':', 1)[1]}"] += inst["requests"]
        done += d["completed"]
        drifts.append(f"{d['ttft_drift']:.2f}")
        phases = " | ".join(f"{k} {v:.1f}" for k, v in d["phase_medians_ms"].items())
        phase_lines.append(f"{arm:24s} iter {d['iteration']}: {phases}")
    prefill_lines.append(prefills(HERE / folder, arm, route))
    turns = " / ".join(med(by_turn[k]) for k in sorted(by_turn))
    insts = " / ".join(str(v) for v in per_instance.values())
    whole, split = len(by_route["whole"]), len(by_route["split"])
    print(
        f"{folder:10s} {arm:24s} n={len(ttfts):3d} TTFT med {statistics.median(ttfts):6.0f} p99 {pct(ttfts, 0.99):6.0f}"
        f" | turns {turns:22s} | TPOT {statistics.median(tpots):5.1f} | hit {100 * hit / max(prompt, 1):3.0f}%"
        f" | KV/req {kv_in / max(done, 1) / 2**10:7.1f} KiB | whole/split {whole}/{split}"
        f" (TTFT {med(by_route['whole'])}/{med(by_route['split'])}) | per instance {insts} | drift {', '.join(drifts)}"
    )
print()
print("\n".join(phase_lines))
print()
print("\n".join(line for line in prefill_lines if line))
