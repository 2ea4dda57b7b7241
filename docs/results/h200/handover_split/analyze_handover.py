"""Medians of P's hand-over parts from a sweep's timeline_<mode>.json, per prompt-length class (by prefill time):
first_token -> send_taken (the engine handing the finished prefill to the transfer thread) -> transfer_posted."""
import json, statistics, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    rows = {}
    for e in d["prefill"]:
        ev = e["events"]
        if not all(k in ev for k in ("first_token", "send_taken", "transfer_posted", "prefill_start")):
            continue
        pre = 1e3 * (ev["first_token"] - ev["prefill_start"])
        cls = "short(<20ms)" if pre < 20 else ("mid(<80ms)" if pre < 80 else "long")
        rows.setdefault(cls, []).append((1e3 * (ev["send_taken"] - ev["first_token"]), 1e3 * (ev["transfer_posted"] - ev["send_taken"]), pre))
    for cls, r in sorted(rows.items()):
        a = sorted(x[0] for x in r); b = sorted(x[1] for x in r)
        print(f"{path} {cls}: n={len(r)} prefill~{statistics.median(x[2] for x in r):.0f} ms | first_token->send_taken med {statistics.median(a):.2f} max {a[-1]:.2f} | send_taken->posted med {statistics.median(b):.2f} max {b[-1]:.2f}")
