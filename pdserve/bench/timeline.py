"""Per-request timelines from the servers' timestamps, joined across P and D and drawn as a Gantt chart.

Each server's `GET /timeline` returns a JSON list of {"request_id", "client_request_id", "role":
"prefill"|"decode"|"both", "events": {name: unix_time}}; the event names are EVENT_NAMES. `request_id` is the
server's own; the router sends one X-Request-Id on both legs, which each server records as
`client_request_id`, so a request's prefill and decode entries share that id (up to a "cmpl-" style prefix).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENT_NAMES = (
    "arrival",
    "prefill_start",
    "prefill_end",
    "registration_sent",
    "registration_received",
    "transfer_posted",
    "transfer_done",
    "kv_received",
    "first_decode_step",
    "first_token",
    "finished",
)
ID_PREFIXES = ("chatcmpl-", "cmpl-", "req-")

# (label, color, lane, start candidates, end candidates); a candidate is (role, event), first present wins.
# lane 0 = the prefill instance (upper half of a row), lane 1 = the decode instance (lower half).
SEGMENTS = (
    ("P queue", "0.8", 0, [("P", "arrival")], [("P", "prefill_start")]),
    ("prefill", "tab:blue", 0, [("P", "prefill_start")], [("P", "prefill_end"), ("P", "first_token")]),
    ("transfer", "tab:red", 0, [("P", "transfer_posted")], [("P", "transfer_done")]),
    ("D waits for KV", "khaki", 1, [("D", "arrival")], [("D", "kv_received"), ("D", "transfer_done")]),
    ("transfer", "tab:red", 1, [("D", "transfer_posted")], [("D", "transfer_done")]),
    ("first decode step", "tab:green", 1, [("D", "kv_received"), ("D", "first_decode_step")], [("D", "first_token")]),
    ("decode", "palegreen", 1, [("D", "first_token")], [("D", "finished")]),
)
MARKERS = (  # (label, marker, lane, role, event)
    ("registration sent", "v", 1, "D", "registration_sent"),
    ("registration received", "^", 0, "P", "registration_received"),
)


@dataclass
class RequestTimeline:
    """One request's events on each instance; unix seconds."""

    request_id: str
    prefill: dict[str, float] = field(default_factory=dict)  # events seen by the prefill instance
    decode: dict[str, float] = field(default_factory=dict)  # events seen by the decode instance
    router: dict[str, float] = field(default_factory=dict)  # the router's edge events (http_timeline.py)

    def event(self, role: str, name: str) -> float | None:
        """`role`: "P", "D" or "R" (the router)."""
        return {"P": self.prefill, "D": self.decode, "R": self.router}[role].get(name)

    @property
    def start(self) -> float:
        times = list(self.prefill.values()) + list(self.decode.values())
        return min(times) if times else 0.0


def normalize_id(request_id: str) -> str:
    for prefix in ID_PREFIXES:
        if request_id.startswith(prefix):
            return request_id[len(prefix) :]
    return request_id


def _events(entry: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in (entry.get("events") or {}).items() if v is not None}


def join(
    prefill_entries: list[dict], decode_entries: list[dict], router_entries: list[dict] | None = None
) -> list[RequestTimeline]:
    """Match entries by request id; a "both" entry fills both lanes. A router's entry (role "router") adds its
    events to a request an instance saw. Sorted by first event."""
    by_id: dict[str, RequestTimeline] = {}
    sources = ((prefill_entries, "prefill"), (decode_entries, "decode"), (router_entries or [], "router"))
    for entries, default_role in sources:
        for entry in entries:
            key = normalize_id(str(entry.get("client_request_id") or entry.get("request_id", "")))
            if default_role == "router" and key not in by_id:
                continue
            tl = by_id.setdefault(key, RequestTimeline(key))
            role = entry.get("role", default_role)
            if role in ("prefill", "both"):
                tl.prefill.update(_events(entry))
            if role in ("decode", "both"):
                tl.decode.update(_events(entry))
            if role == "router":
                tl.router.update(_events(entry))
    return sorted(by_id.values(), key=lambda t: t.start)


def fetch(url: str, timeout_s: float = 10.0) -> list[dict]:
    """A server's /timeline entries (accepts a bare list or {"requests": [...]})."""
    with urllib.request.urlopen(url.rstrip("/") + "/timeline", timeout=timeout_s) as response:
        data = json.loads(response.read())
    return data.get("requests", []) if isinstance(data, dict) else data


def save(
    path: Path, mode: str, prefill_entries: list[dict], decode_entries: list[dict], router_entries: Sequence[dict] = ()
) -> None:
    """Write one mode's /timeline entries of both instances (and the router's) to one file (what `load_saved`
    reads)."""
    data = {"mode": mode, "prefill": prefill_entries, "decode": decode_entries, "router": list(router_entries)}
    path.write_text(json.dumps(data))


def load_saved(path: Path) -> tuple[str, list[RequestTimeline]]:
    """A file written by `pdserve sweep --save-timeline` or `pdserve timeline --save-dir`: (mode, timelines)."""
    data = json.loads(Path(path).read_text())
    timelines = join(data.get("prefill", []), data.get("decode", []), data.get("router", []))
    return data.get("mode", Path(path).stem), timelines


def _span(tl: RequestTimeline, starts: list, ends: list) -> tuple[float, float] | None:
    start = next((t for t in (tl.event(*c) for c in starts) if t is not None), None)
    end = next((t for t in (tl.event(*c) for c in ends) if t is not None), None)
    if start is None or end is None or end < start:
        return None
    return start, end


def draw(panels: list[tuple[str, list[RequestTimeline]]], out: Path, max_requests: int = 24) -> Path:
    """One Gantt panel per (title, timelines), side by side, x in ms since the panel's first event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("nothing to draw")
    num_rows = max(1, max(min(len(t), max_requests) for _, t in panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 1.2 + 0.32 * num_rows), squeeze=False)
    legend: dict[str, Any] = {}
    for ax, (title, timelines) in zip(axes[0], panels, strict=True):
        shown = timelines[-max_requests:]
        t0 = min((t.start for t in shown), default=0.0)
        for row, tl in enumerate(shown):
            for label, color, lane, starts, ends in SEGMENTS:
                span = _span(tl, starts, ends)
                if span is None:
                    continue
                y = row + (0.05 if lane == 0 else 0.5)
                ax.broken_barh([((span[0] - t0) * 1e3, (span[1] - span[0]) * 1e3)], (y, 0.42), color=color)
                legend.setdefault(label, Patch(color=color, label=label))
            for label, marker, lane, role, name in MARKERS:
                t = tl.event(role, name)
                if t is not None:
                    y = row + (0.26 if lane == 0 else 0.71)
                    (handle,) = ax.plot([(t - t0) * 1e3], [y], marker, color="purple", markersize=5, label=label)
                    legend.setdefault(label, handle)
        ax.set_yticks([r + 0.5 for r in range(len(shown))])
        ax.set_yticklabels([tl.request_id[-14:] for tl in shown], fontsize=7)
        ax.set_ylim(len(shown), 0)
        ax.set_xlabel("ms since first event (upper half of a row: prefill instance, lower: decode)")
        ax.set_title(f"{title}: {len(shown)} of {len(timelines)} requests")
        ax.grid(True, axis="x", alpha=0.3)
    fig.legend(handles=list(legend.values()), loc="lower center", ncol=min(8, max(1, len(legend))), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
