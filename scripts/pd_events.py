"""Per-request P/D event table from a sweep's timeline_<mode>.json (`pdserve sweep --save-timeline`).

    python scripts/pd_events.py RESULTS_DIR/timeline_pull.json

One row per request (ordered by D's arrival), times in ms from the first request's arrival on P: where a
request waits between P's first token, D's arrival, the transfer being posted and done, and D's first token.
"""

from __future__ import annotations

import json
import sys

COLUMNS = [
    ("prefill", "arrival"),
    ("prefill", "first_token"),
    ("decode", "arrival"),
    ("decode", "transfer_posted"),
    ("decode", "transfer_done"),
    ("decode", "registration_sent"),
    ("decode", "kv_received"),
    ("decode", "scheduled"),
    ("decode", "first_token"),
    ("decode", "finished"),
]


def main(path: str) -> None:
    data = json.load(open(path))
    by_id: dict[str, dict[str, dict[str, float]]] = {}
    for role in ("prefill", "decode"):
        for entry in data[role]:
            by_id.setdefault(entry["request_id"], {})[role] = entry["events"]
    rows = [(rid, ev) for rid, ev in by_id.items() if "decode" in ev and "prefill" in ev]
    rows.sort(key=lambda r: r[1]["decode"].get("arrival", 0))
    if not rows:
        print("no request seen on both P and D")
        return
    t0 = min(ev["prefill"].get("arrival", float("inf")) for _, ev in rows)
    print(f"mode {data.get('mode')}: ms since the first arrival on P")
    print(f"{'request':<24}" + "".join(f"{(r[0][0] + '.' + r[1])[:14]:>15}" for r in COLUMNS))
    for rid, ev in rows:
        cells = []
        for role, name in COLUMNS:
            t = ev[role].get(name)
            cells.append(f"{(t - t0) * 1e3:>15.1f}" if t is not None else f"{'-':>15}")
        print(f"{rid[:24]:<24}" + "".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
