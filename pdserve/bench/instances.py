"""What each instance did during one sweep point: its /metrics counters scraped right before and right after the
point, as deltas (issue 29 item 5: KV bytes moved per request, prefix hit rate per instance).

Every instance is scraped once it has settled (no request running or waiting, every KV block free or only
prefix-cached: pins of finished prefills released, so P's sent bytes are counted), or after SETTLE_S with what
it has. The point's JSON gets `instances` (one entry per instance: url, role, and the deltas below, with
hit_rate = prefix_hit_tokens / prompt_tokens), `kv_bytes_per_request` (bytes received by the decode-side
instances / completed requests) and `prefix_hit_rate` (every instance pooled: P and D each count the prompts
they admitted). A counter an instance does not export (an older server) is None; an instance that does not
answer leaves the point without these keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.scrape import scrape_metrics

SETTLE_S = 10.0  # how long to wait for every instance to settle before and after a point
POLL_S = 0.1
COUNTERS = {  # key in the point's JSON -> the instance's counter (pdserve/server/metrics.py)
    "requests": "pdserve_requests_started_total",
    "prompt_tokens": "pdserve_prompt_tokens_total",
    "prefix_hit_tokens": "pdserve_prefix_cache_hit_tokens_total",
    "kv_sent_bytes": "pdserve_kv_sent_bytes_total",
    "kv_received_bytes": "pdserve_kv_received_bytes_total",
}
BUSY = ("pdserve_requests_running", "pdserve_requests_waiting", "pdserve_requests_waiting_for_kv")
Scrape = dict[str, float]  # one instance's /metrics as {"name{labels}": value}


@dataclass(frozen=True)
class Instance:
    """One server of a deployment the sweep loads."""

    url: str  # its base URL (its /metrics is open: the sweep's deployments have no client key)
    role: str  # prefill | decode | both (colocated)


def instances_of(prefill_urls: Sequence[str], decode_urls: Sequence[str], both_urls: Sequence[str]) -> list[Instance]:
    return (
        [Instance(u, "prefill") for u in prefill_urls]
        + [Instance(u, "decode") for u in decode_urls]
        + [Instance(u, "both") for u in both_urls]
    )


def is_settled(m: Scrape) -> bool:
    """No request running or waiting, and every KV block free (prefix-cached blocks count as free)."""
    busy = sum(m.get(name, 0.0) for name in BUSY)
    return busy == 0 and m.get("pdserve_kv_blocks_free") == m.get("pdserve_kv_blocks_total")


def scrape_settled(instances: Sequence[Instance], settle_s: float = SETTLE_S) -> dict[str, Scrape]:
    """Every instance's scrape, once each has settled (or the last one after settle_s); raises httpx.HTTPError
    when one does not answer."""
    deadline = time.monotonic() + settle_s
    out: dict[str, Scrape] = {}
    for inst in instances:
        while not is_settled(m := scrape_metrics(inst.url)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        out[inst.url] = m
    return out


def _delta(before: Scrape, after: Scrape, name: str) -> float | None:
    if name not in before or name not in after:
        return None
    return after[name] - before[name]


def _rate(hits: float | None, total: float | None) -> float | None:
    return None if hits is None or not total else hits / total


def point_counts(
    instances: Sequence[Instance], before: Mapping[str, Scrape], after: Mapping[str, Scrape], completed: int
) -> dict[str, Any]:
    """The keys a point's JSON gets from the scrapes before and after it (module docstring)."""
    rows: list[dict[str, Any]] = []
    for inst in instances:
        row: dict[str, Any] = {"url": inst.url, "role": inst.role}
        for key, name in COUNTERS.items():
            value = _delta(before[inst.url], after[inst.url], name)
            row[key] = None if value is None else int(value)
        row["hit_rate"] = _rate(row["prefix_hit_tokens"], row["prompt_tokens"])
        rows.append(row)
    received = [r["kv_received_bytes"] for r in rows if r["role"] != "prefill"]
    per_request = None if None in received or not completed else sum(received) / completed
    hits, prompts = [r["prefix_hit_tokens"] for r in rows], [r["prompt_tokens"] for r in rows]
    pooled = None if None in hits or None in prompts else _rate(sum(hits), sum(prompts))
    return {"instances": rows, "kv_bytes_per_request": per_request, "prefix_hit_rate": pooled}


class PointCounters:
    """Scrapes a deployment's instances around one point: `start()` before it, `finish(completed)` after."""

    def __init__(self, instances: Sequence[Instance], log: Callable[[str], None]) -> None:
        self.instances = list(instances)  # none: an attached deployment without its instances' URLs
        self.log = log  # where a failed scrape is reported (the point goes on without these keys)
        self._before: dict[str, Scrape] | None = None  # the scrape before the point; None if it failed

    def _scrape(self) -> dict[str, Scrape] | None:
        try:
            return scrape_settled(self.instances)
        except (httpx.HTTPError, ValueError) as e:
            self.log(f"no instance counters: {e}")
            return None

    def start(self) -> None:
        self._before = self._scrape() if self.instances else None

    def finish(self, completed: int) -> dict[str, Any]:
        """The point's keys ({} when a scrape failed or there are no instances)."""
        if self._before is None:
            return {}
        after = self._scrape()
        return {} if after is None else point_counts(self.instances, self._before, after, completed)


def instances_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per result with instance counts: KV bytes per request, the pooled prefix hit rate, and each
    instance's role, hit rate and KV bytes received; "" when no result has them."""
    lines = ["per instance (deltas over the point): hit = prefix-cache hit tokens / prompt tokens admitted"]
    for r in sorted(results, key=lambda r: (float(r["qps"]), r["input_len"], r["output_len"], r["mode"])):
        if not r.get("instances"):
            continue
        label = f"{r['qps']} qps {r['input_len']}/{r['output_len']} #{r.get('iteration', 0)}"
        per_request, pooled = r.get("kv_bytes_per_request"), r.get("prefix_hit_rate")
        head = f"{label:>22}  {r['mode']:9}  KV/req {_kib(per_request)}, hit {_pct(pooled)}"
        parts = [_instance_cell(n, i) for n, i in enumerate(r["instances"])]
        lines.append(head + "  | " + " | ".join(parts))
    return "\n".join(lines) if len(lines) > 1 else ""


def _instance_cell(index: int, i: Mapping[str, Any]) -> str:
    """`D1 4 req, hit 50%, in 12.0 KiB`: role letter and position, requests, hit rate, KV bytes received (a
    prefill instance: `out`, bytes sent)."""
    role = i["role"][0].upper()
    moved = f"out {_kib(i['kv_sent_bytes'])}" if i["role"] == "prefill" else f"in {_kib(i['kv_received_bytes'])}"
    return f"{role}{index} {i['requests']} req, hit {_pct(i['hit_rate'])}, {moved}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _kib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024:.1f} KiB"
