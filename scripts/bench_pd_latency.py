"""Push vs pull on this machine: how long from P's prefill end to D's request being runnable, TTFT, and how
long D's engine loop spends on transfer work, from the servers' own timestamps and counters.

Usage: .venv/bin/python scripts/bench_pd_latency.py [--model smollm2-135m] [--lengths 128 512 1024 2048]
       [--requests 3] [--out docs/results/cpu/pd_latency.json]
       .venv/bin/python scripts/bench_pd_latency.py --render docs/results/cpu/pd_latency.json  (table again)

One 1P1D deployment + router per mode (pdserve.bench.deploy), both up for the whole run; requests are
sequential and alternate between the modes (pull, push, pull, push, ...) so both see the same machine load.
Each prompt is fresh random token ids (no prefix-cache hit on P; D runs without a prefix cache). After the
run, GET /timeline from every instance gives per-request events (unix seconds, one clock: same machine):

  P first_token   P has run the prompt and sampled its one token (P's "prefill end"; P marks "finished"
                  in the same step, and that is when the KV is handed to the transfer thread)
  D kv_received   D's transfer thread has all the KV (push: every completion notification; pull: the READ)
  D scheduled     D's engine loop has put the request in its running batch (runnable -> running)

and /metrics before and after each (mode, length) gives D's pdserve_engine_transfer_hook_seconds_total and
pdserve_engine_steps_total: engine-thread time spent in the connector hooks (submitting transfer work,
taking results) — what the transfer design costs D's decode loop directly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.scrape import scrape_metrics
from pdserve.bench.spans import SPANS, derive, median, one_request, run_header, timelines

MODES = ("pull", "push")


def hook_counters(url: str) -> tuple[float, float]:
    m = scrape_metrics(url)
    return m["pdserve_engine_transfer_hook_seconds_total"], m["pdserve_engine_steps_total"]


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


TABLE = (  # (summary key, header, unit, digits)
    ("median_prefill_ms", "prefill", "ms", 1),
    ("median_prefill_end_to_transfer_posted_ms", "P end -> posted", "ms", 2),
    ("median_transfer_posted_to_kv_received_ms", "posted -> D has KV", "ms", 2),
    ("median_prefill_end_to_kv_received_ms", "P end -> D has KV", "ms", 2),
    ("median_kv_received_to_d_scheduled_ms", "D has KV -> scheduled", "ms", 2),
    ("median_client_ttft_ms", "TTFT", "ms", 0),
    ("d_hook_us_per_request", "D hooks / request", "us", 0),
    ("d_hook_us_per_step", "D hooks / step", "us", 1),
    ("d_steps_per_request", "D steps / request", "", 0),
)


def table(summary: list[dict[str, Any]]) -> list[str]:
    """A markdown table of the summary cells."""
    head = ["mode", "input tokens"] + [f"{h} ({u})" if u else h for _, h, u, _ in TABLE]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [s["mode"], str(s["input_len"])] + [fmt(s.get(k), digits) for k, _, _, digits in TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pull_over_push(summary: list[dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    ratios = []
    for length in lengths:
        pull, push = (next(s for s in summary if s["mode"] == m and s["input_len"] == length) for m in MODES)
        a, b = pull["median_prefill_end_to_kv_received_ms"], push["median_prefill_end_to_kv_received_ms"]
        ttft = pull["median_client_ttft_ms"] / push["median_client_ttft_ms"]
        ratios.append(
            {"input_len": length, "pull_over_push_handoff": a / b if a and b else None, "pull_over_push_ttft": ttft}
        )
    return ratios


def report(lines: list[str], ratios: list[dict[str, Any]]) -> str:
    out = list(lines)
    for r in ratios:
        handoff, ttft = fmt(r["pull_over_push_handoff"], 2), fmt(r["pull_over_push_ttft"], 2)
        out.append(f"pull / push at {r['input_len']} tokens: P end -> D has KV {handoff}x, TTFT {ttft}x")
    return "\n".join(out)


def render(path: str) -> int:
    """Print the table of a saved result again (the current columns)."""
    result = json.loads(Path(path).read_text())
    lengths = sorted({s["input_len"] for s in result["summary"]})
    for cell in result["summary"]:  # medians of spans added after the result was saved
        rows = [r for r in result["requests"] if r["mode"] == cell["mode"] and r["input_len"] == cell["input_len"]]
        for k in SPANS:
            cell.setdefault(f"median_{k}", median(rows, k))
    print(
        f"{result['command']}  ({result['date']}, load average {result['machine']['load_average_before'][0]:.1f}"
        f" before, {result['machine']['load_average_after'][0]:.1f} after)"
    )
    print(report(table(result["summary"]), pull_over_push(result["summary"], lengths)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="built-in model or preset (with --load-format dummy)")
    ap.add_argument("--load-format", default=None, help="dummy = random weights for a shape preset")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048], help="prompt tokens")
    ap.add_argument("--requests", type=int, default=3, help="measured requests per mode and length")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode and length")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--vocab-low", type=int, default=1000, help="random prompt ids are drawn from [low, high)")
    ap.add_argument("--vocab-high", type=int, default=40000)
    ap.add_argument("--log-dir", default="/tmp/pdserve-bench-pd-latency")
    ap.add_argument("--out", default="docs/results/cpu/pd_latency.json")
    ap.add_argument("--render", metavar="JSON", help="only print the table of a saved result")
    args = ap.parse_args()
    if args.render:
        return render(args.render)

    rng = random.Random(0)
    extra = ("--kv-cache-memory-gib", "0.5")
    options = ServerOptions(
        model=args.model,
        load_format=args.load_format,
        num_threads=args.num_threads,
        max_model_len=max(args.lengths) + args.max_tokens + 16,
        extra_args=extra,
    )
    load_before = os.getloadavg()
    deployments = {m: Deployment(options, m, Path(args.log_dir)) for m in MODES}
    rows: list[dict[str, Any]] = []
    hooks: list[dict[str, Any]] = []
    try:
        for m in MODES:
            print(f"starting 1P1D + router, {m} mode (logs in {args.log_dir})", flush=True)
            deployments[m].start()
        for length in args.lengths:
            before = {m: hook_counters(deployments[m].decode_url) for m in MODES}
            before_p = {m: hook_counters(deployments[m].prefill_url) for m in MODES}
            for i in range(args.warmup + args.requests):
                for m in MODES:  # interleaved: both modes see the same load
                    prompt = [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(length)]
                    rid = f"{m}-{length}-{i}-{uuid.uuid4().hex[:8]}"
                    client = one_request(deployments[m].router_url, prompt, args.max_tokens, rid)
                    if i >= args.warmup:
                        rows.append({"mode": m, "input_len": length, "request_id": rid, **client})
            for m in MODES:
                (h1, s1), (h0, s0) = hook_counters(deployments[m].decode_url), before[m]
                (ph1, ps1), (ph0, ps0) = hook_counters(deployments[m].prefill_url), before_p[m]
                n = args.warmup + args.requests
                hooks.append(
                    dict(
                        mode=m,
                        input_len=length,
                        requests=n,
                        d_hook_s=h1 - h0,
                        d_steps=s1 - s0,
                        p_hook_s=ph1 - ph0,
                        p_steps=ps1 - ps0,
                    )
                )
            print(f"  {length} tokens done", flush=True)
        for m in MODES:
            p_tl, d_tl = timelines(deployments[m].prefill_url), timelines(deployments[m].decode_url)
            for row in rows:
                if row["mode"] == m:
                    row.update(derive(p_tl[row["request_id"]], d_tl[row["request_id"]]))
    finally:
        for dep in deployments.values():
            dep.stop()
    load_after = os.getloadavg()

    summary = []
    for length in args.lengths:
        for m in MODES:
            rs = [r for r in rows if r["mode"] == m and r["input_len"] == length]
            h = next(x for x in hooks if x["mode"] == m and x["input_len"] == length)
            cell: dict[str, Any] = {"mode": m, "input_len": length, "requests": len(rs)}
            cell.update({f"median_{k}": median(rs, k) for k in SPANS})
            cell["median_client_ttft_ms"] = 1000 * statistics.median(r["ttft_s"] for r in rs)
            cell["d_hook_us_per_request"] = 1e6 * h["d_hook_s"] / h["requests"]
            cell["d_hook_us_per_step"] = 1e6 * h["d_hook_s"] / max(1, h["d_steps"])
            cell["d_steps_per_request"] = h["d_steps"] / h["requests"]
            cell["p_hook_us_per_request"] = 1e6 * h["p_hook_s"] / h["requests"]
            summary.append(cell)

    lines, ratios = table(summary), pull_over_push(summary, args.lengths)
    print(f"\nmedians over {args.requests} requests per cell (after {args.warmup} warm-up):")
    print(report(lines, ratios))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cores)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        **run_header(load_before, load_after),
        "options": {k: v for k, v in vars(args).items() if k not in ("out", "render")},
        "summary": summary,
        "ratios": ratios,
        "hook_counters": hooks,
        "requests": rows,
        "table": lines,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
