"""One request through a 1P1D deployment, and where its time went from P's and D's own timelines.

Shared by the benchmarks that compare deployments request by request (scripts/bench_pd_latency.py,
scripts/bench_kv_checksum.py): each sends sequential streamed requests with its own X-Request-Id, then reads
GET /timeline from both instances once and derives per-request spans (`derive`) from the events there
(unix seconds; one clock, as the instances run on one machine).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# the spans `derive` can give, in ms (the transfer ones only where P or D records the transfer)
SPANS = (
    "prefill_ms",
    "prefill_end_to_kv_received_ms",
    "prefill_end_to_d_scheduled_ms",
    "kv_received_to_d_scheduled_ms",
    "transfer_ms",
    "d_arrival_after_prefill_end_ms",
    "prefill_end_to_transfer_posted_ms",
    "transfer_posted_to_kv_received_ms",
)


def one_request(router: str, prompt: list[int], max_tokens: int, request_id: str) -> dict[str, float]:
    """A streamed greedy completion of token ids through the router: client-side TTFT and latency, seconds."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    ttft = None
    with httpx.stream(
        "POST", router + "/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=600
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{request_id}: HTTP {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and ttft is None and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text") is not None:
                    ttft = time.perf_counter() - started
    return {"ttft_s": ttft if ttft is not None else float("nan"), "latency_s": time.perf_counter() - started}


def timelines(url: str) -> dict[str, dict[str, float]]:
    """An instance's events per request, by the X-Request-Id the client sent (the server's own id otherwise)."""
    entries = httpx.get(url + "/timeline", timeout=30, trust_env=False).json()
    return {e.get("client_request_id") or e["request_id"]: e["events"] for e in entries}


def derive(p: dict[str, float], d: dict[str, float]) -> dict[str, float]:
    """Per-request spans in ms from P's and D's events. P's first_token is its prefill end (P marks the request
    finished in the same step and hands the KV to its transfer thread); D's kv_received is its transfer thread
    holding all the KV; D's scheduled is the request entering D's running batch."""
    ms = lambda a, b: 1000.0 * (b - a)  # noqa: E731
    out = {
        "prefill_ms": ms(p["prefill_start"], p["first_token"]),
        "prefill_end_to_kv_received_ms": ms(p["first_token"], d["kv_received"]),
        "prefill_end_to_d_scheduled_ms": ms(p["first_token"], d["scheduled"]),
        "kv_received_to_d_scheduled_ms": ms(d["kv_received"], d["scheduled"]),
        "d_first_token_after_kv_ms": ms(d["kv_received"], d["first_token"]),
        "server_ttft_ms": ms(p["arrival"], d["first_token"]),
    }
    posted, done = (p, p) if "transfer_posted" in p else (d, d)
    if "transfer_posted" in posted and "transfer_done" in done:
        out["transfer_ms"] = ms(posted["transfer_posted"], done["transfer_done"])
        out["prefill_end_to_transfer_posted_ms"] = ms(p["first_token"], posted["transfer_posted"])
        out["transfer_posted_to_kv_received_ms"] = ms(posted["transfer_posted"], d["kv_received"])
    out["d_arrival_after_prefill_end_ms"] = ms(p["first_token"], d["arrival"])  # < 0 in push: D was there first
    return out


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median of `key` over the rows that have it (NaN skipped); None when none has."""
    values = [r[key] for r in rows if key in r and r[key] == r[key]]
    return statistics.median(values) if values else None


def run_header(load_before: tuple[float, ...], load_after: tuple[float, ...], **machine: Any) -> dict[str, Any]:
    """What a saved result records about its run: the command line, the date and the machine (with the load
    averages before and after the run); `machine` adds fields (device names)."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            **machine,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
    }
