"""Where a request's time to first token goes: its phases, from the client's clock and the servers' timelines.

Each phase is the time between two events of one request, each looked up on the client ("C": sent, first token
received), the prefill instance ("P") or the decode instance ("D"); a colocated request's instance is both.
All clocks are unix time on one machine (the servers' timelines use time.time(); the bench client converts its
perf_counter). The phases of a mode follow one another, so their medians add up to about the median TTFT: a
change that moves time from one phase into another shows as such, not only as a new total.

- push: router -> P, P queue, prefill (to P's first token), hand-over (P's first token -> WRITE posted),
  transfer (WRITE posted -> KV landed on D), KV landed -> D's first token, D -> client.
- pull: router -> P, P queue, prefill, relay (P's first token -> D's leg arrives: P's answer, the router,
  D's parsing), D arrival -> READ posted, transfer (READ posted -> KV landed), KV landed -> D's first token,
  D -> client.
"KV->D token" is the engine loop noticing the landed KV and emitting the first token P handed over with it
(docs/architecture.md, "The engine"); where D computes the last prompt token itself (a prefill instance that
hands no token over, such as vLLM's), it also holds D's wait to be scheduled and its first step.
- colocated: router -> instance, queue, prefill (to its first token), instance -> client.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.bench.phase_split import split_medians
from pdserve.bench.timeline import RequestTimeline, join, normalize_id

Event = tuple[str, str]  # (where: "C", "P" or "D", event name)
Phase = tuple[str, Event, Event]  # (label, start, end)

PHASES: dict[str, tuple[Phase, ...]] = {
    "push": (
        ("router->P", ("C", "sent"), ("P", "arrival")),
        ("P queue", ("P", "arrival"), ("P", "prefill_start")),
        ("prefill", ("P", "prefill_start"), ("P", "first_token")),
        ("hand-over", ("P", "first_token"), ("P", "transfer_posted")),
        ("transfer", ("P", "transfer_posted"), ("D", "kv_received")),
        ("KV->D token", ("D", "kv_received"), ("D", "first_token")),
        ("D->client", ("D", "first_token"), ("C", "first_token")),
    ),
    "pull": (
        ("router->P", ("C", "sent"), ("P", "arrival")),
        ("P queue", ("P", "arrival"), ("P", "prefill_start")),
        ("prefill", ("P", "prefill_start"), ("P", "first_token")),
        ("relay", ("P", "first_token"), ("D", "arrival")),
        ("D->READ", ("D", "arrival"), ("D", "transfer_posted")),
        ("transfer", ("D", "transfer_posted"), ("D", "kv_received")),
        ("KV->D token", ("D", "kv_received"), ("D", "first_token")),
        ("D->client", ("D", "first_token"), ("C", "first_token")),
    ),
    "colocated": (
        ("router->inst", ("C", "sent"), ("P", "arrival")),
        ("queue", ("P", "arrival"), ("P", "prefill_start")),
        ("prefill", ("P", "prefill_start"), ("P", "first_token")),
        ("inst->client", ("P", "first_token"), ("C", "first_token")),
    ),
}


def _time(event: Event, tl: RequestTimeline, client: Mapping[str, float]) -> float | None:
    where, name = event
    return client.get(name) if where == "C" else tl.event(where, name)


def request_phases(mode: str, tl: RequestTimeline, client: Mapping[str, float]) -> dict[str, float]:
    """One request's phases in seconds (those whose two events are both known and in order)."""
    out = {}
    for label, start, end in PHASES[mode]:
        t0, t1 = _time(start, tl, client), _time(end, tl, client)
        if t0 is not None and t1 is not None and t1 >= t0:
            out[label] = t1 - t0
    return out


def phase_medians(
    mode: str, result: Mapping[str, Any], prefill_entries: list[dict], decode_entries: list[dict]
) -> dict[str, Any]:
    """The median of each phase (ms) over a bench result's successful requests, joined with the servers'
    /timeline entries by request id; plus how many requests each median covers and the first-to-second-token
    gap (median and p99, ms), so that time moved out of TTFT stays visible."""
    timelines = {tl.request_id: tl for tl in join(prefill_entries, decode_entries)}
    per_phase: dict[str, list[float]] = {label: [] for label, _, _ in PHASES[mode]}
    seen: list[tuple[RequestTimeline, dict[str, float]]] = []  # for the phases' splits (phase_split.py)
    num_prepared = 0  # push: requests whose WRITE was laid out before the prefill ended
    rows = zip(result["request_ids"], result["start_times"], result["ttfts"], result["errors"], strict=True)
    for rid, sent, ttft, error in rows:
        tl = timelines.get(normalize_id(rid))
        if tl is None or error or not ttft:
            continue
        client = {"sent": sent, "first_token": sent + ttft}
        for label, seconds in request_phases(mode, tl, client).items():
            per_phase[label].append(seconds)
        seen.append((tl, client))
        prepared, taken = tl.event("P", "write_prepared"), tl.event("P", "send_taken")
        num_prepared += prepared is not None and taken is not None and prepared <= taken
    first_gaps = [gaps[0] for gaps, error in zip(result["itls"], result["errors"], strict=True) if gaps and not error]
    return {
        "phase_medians_ms": {k: 1000 * statistics.median(v) if v else None for k, v in per_phase.items()},
        "phase_counts": {k: len(v) for k, v in per_phase.items()},
        "phase_splits_ms": split_medians(mode, seen),  # phase -> step -> median ms
        "num_write_prepared": num_prepared,
        "median_first_itl_ms": 1000 * statistics.median(first_gaps) if first_gaps else None,
        "p99_first_itl_ms": 1000 * _quantile(first_gaps, 0.99) if first_gaps else None,
    }


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def phases_table(
    rows: Sequence[tuple[str, str, Mapping[str, float | None]]],
    splits: Sequence[Mapping[str, Mapping[str, float]]] = (),
) -> str:
    """Rows of (point label, mode, phase medians in ms) as text: one line per (point, mode), its phases in order
    and their sum; modes of one point follow one another so colocated's own phases sit beside push and pull.
    splits[i], when given: row i's phase splits (phase_split.split_medians), a line per phase under it."""
    lines = ["where the time to first token goes (median ms per phase; sum ~ median TTFT)"]
    for i, (point, mode, medians) in enumerate(rows):
        parts = [f"{k} {v:.2f}" for k, v in medians.items() if v is not None]
        total = sum(v for v in medians.values() if v is not None)
        lines.append(f"{point:>22}  {mode:9}  " + " | ".join(parts) + f"  = {total:.2f}")
        for phase, steps in (splits[i] if i < len(splits) else {}).items():
            lines.append(f"{'':>33}{phase}: " + " | ".join(f"to {k} {v:.2f}" for k, v in steps.items()))
    return "\n".join(lines)


def phases_summary(results: Sequence[Mapping[str, Any]]) -> str:
    """phases_table over sweep results (each with mode, qps, input_len, output_len, iteration and
    phase_medians_ms): one line per result, grouped by point, modes in push, pull, colocated order."""
    order = {"push": 0, "pull": 1, "colocated": 2}
    rows, splits = [], []
    key = lambda r: (float(r["qps"]), r["input_len"], r["output_len"], r.get("iteration", 0), order.get(r["mode"], 3))  # noqa: E731
    for r in sorted(results, key=key):
        if r.get("phase_medians_ms"):
            label = f"{r['qps']} qps {r['input_len']}/{r['output_len']} #{r.get('iteration', 0)}"
            rows.append((label, r["mode"], r["phase_medians_ms"]))
            splits.append(r.get("phase_splits_ms") or {})
    return phases_table(rows, splits) if rows else ""
