"""Selective disaggregation on the CPU: the router's --colocate-below threshold off and at a few values.

    python scripts/bench_colocate_below.py [--thresholds off,128,2048] [--rate 0.3] [--num-prompts 24] [--rounds 2]

One push 1P1D pair of the built-in model serves every configuration: one router per threshold (all in front
of the same two instances, with the deployment's secret), so only the routing differs. The workload mixes
short and long token-id prompts (--short-len / --long-len, --long-every: one long prompt in N) at a Poisson
rate, ignore_eos, --output-len tokens each. Each round runs every configuration once, in an order rotated
round by round, with fresh prompts (no prefix-cache shortcut); a configuration's rounds are pooled.

Reported per configuration and prompt class: TTFT and TPOT medians (ms), and goodput (requests per second
within --goodput, over the configuration's whole run time), plus each threshold's ratios to "off" measured
in the same rounds: on a machine other work also loads, the ratios are the result, not the absolute times.
Writes docs/results/cpu/colocate_below.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.client import ClientConfig, RequestOutput
from pdserve.bench.dataset import SampleRequest, random_requests
from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.metrics import calculate_metrics, parse_goodput
from pdserve.bench.procs import ManagedProcess
from pdserve.bench.runner import LoadConfig, run_load
from pdserve.bench.tokenizer import Vocab, load_vocab

MODEL = "smollm2-135m"


def workload(vocab: Vocab, args: argparse.Namespace, seed: int, prefix: str) -> list[SampleRequest]:
    """`num_prompts` requests, one in `long_every` long, the rest short, in a seeded random order."""
    num_long = args.num_prompts // args.long_every
    num_short = args.num_prompts - num_long
    short = random_requests(vocab, num_short, args.short_len, args.output_len, 0.0, seed, False, f"{prefix}-s")
    long = random_requests(vocab, num_long, args.long_len, args.output_len, 0.0, seed + 1, False, f"{prefix}-l")
    requests = short + long
    random.Random(seed).shuffle(requests)
    return requests


def start_router(deployment: Deployment, threshold: int | None, log_dir: Path) -> tuple[ManagedProcess, str]:
    argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--mode", "push", "--port", "0"]  # prints its port
    argv += ["--prefill", deployment.prefill_url, "--decode", deployment.decode_url]
    argv += ["--kv-auth-secret-file", str(deployment.secret_file), "--colocate-below", str(threshold)]
    router = ManagedProcess(f"router_below{threshold}", argv, log_dir / f"router_below{threshold}.log")
    url = f"http://127.0.0.1:{router.wait_port(120.0)}"
    router.wait_healthy(url + "/health", 120.0)
    return router, url


def class_metrics(outputs: list[RequestOutput], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    m = calculate_metrics(outputs, duration, goodput)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) * 1000 for o in outputs if o.success and o.output_tokens > 1]
    return {
        "num": len(outputs),
        "failed": m["failed"],
        "median_ttft_ms": m["median_ttft_ms"],
        "p90_ttft_ms": m["p90_ttft_ms"],
        "median_tpot_ms": statistics.median(tpots) if tpots else None,
        "request_goodput": m["request_goodput"],
        "slo_attainment": m["slo_attainment"],
    }


def summarize(runs: list[tuple[list[RequestOutput], float]], args: argparse.Namespace) -> dict[str, Any]:
    goodput = parse_goodput(args.goodput)
    loose = parse_goodput(args.loose_goodput)
    outputs = [o for outs, _ in runs for o in outs]
    duration = sum(d for _, d in runs)
    short = [o for o in outputs if o.request_id.rsplit("-", 2)[-2] == "s"]
    long = [o for o in outputs if o.request_id.rsplit("-", 2)[-2] == "l"]
    summary: dict[str, Any] = {"duration_s": duration}
    for cls, outs in (("short", short), ("long", long), ("all", outputs)):
        summary[cls] = class_metrics(outs, duration, goodput)
        summary[cls]["loose_slo_attainment"] = class_metrics(outs, duration, loose)["slo_attainment"]
    return summary


def per_round_ratios(rounds: list[dict[str, dict[str, Any]]], name: str, cls: str, key: str) -> list[float | None]:
    """`key` of configuration `name` over "off" in the same round, round by round."""
    return [ratio(r[name][cls][key], r["off"][cls][key]) for r in rounds if name in r and "off" in r]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--thresholds", default="off,128,2048", help="router --colocate-below values; off = none")
    ap.add_argument("--rate", type=float, default=0.3, help="requests per second (Poisson)")
    ap.add_argument("--num-prompts", type=int, default=24, help="requests per configuration per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-every", type=int, default=3, help="one long prompt in this many")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per instance")
    ap.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="SLO:MS")
    ap.add_argument(
        "--loose-goodput",
        nargs="+",
        default=["ttft:5000", "tpot:400"],
        metavar="SLO:MS",
        help="a second SLO whose attainment is reported too (a busy 2-core machine misses the first)",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/pdserve-colocate-below"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/cpu/colocate_below.json"))
    args = ap.parse_args()
    thresholds = [None if t == "off" else int(t) for t in args.thresholds.split(",")]
    names = ["off" if t is None else str(t) for t in thresholds]
    vocab = load_vocab(MODEL)
    options = ServerOptions(MODEL, num_threads=args.num_threads, max_model_len=2048)
    runs: dict[str, list[tuple[list[RequestOutput], float]]] = {name: [] for name in names}
    rounds: list[dict[str, dict[str, Any]]] = []  # per round: configuration -> its summary
    with Deployment(options, "push", args.log_dir) as deployment:
        urls = {"off": deployment.router_url}
        routers = []
        try:
            for t, name in zip(thresholds, names, strict=True):
                if t is not None:
                    router, urls[name] = start_router(deployment, t, args.log_dir)
                    routers.append(router)
            for name in names:  # warm-up: one short and one long request through each router
                warm = workload(vocab, argparse.Namespace(**{**vars(args), "num_prompts": 2, "long_every": 2}), 7, name)
                client = ClientConfig(urls[name] + "/v1/completions", MODEL, False, ignore_eos=True)
                asyncio.run(run_load(client, warm, LoadConfig(show_progress=False)))
            for r in range(args.rounds):
                rounds.append({})
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    seed = 1000 * (r + 1) + names.index(name) * 10
                    requests = workload(vocab, args, seed, f"r{r}{name}")
                    client = ClientConfig(urls[name] + "/v1/completions", MODEL, False, ignore_eos=True)
                    load = LoadConfig(request_rate=args.rate, seed=seed, show_progress=False)
                    outputs, duration = asyncio.run(run_load(client, requests, load))
                    runs[name].append((outputs, duration))
                    s = rounds[-1][name] = summarize([(outputs, duration)], args)
                    short_ms, long_ms = s["short"]["median_ttft_ms"], s["long"]["median_ttft_ms"]
                    print(f"round {r} {name:>5}: median TTFT short {short_ms:.0f} ms, long {long_ms:.0f} ms; "
                          f"failed {s['all']['failed']}", flush=True)  # fmt: skip
        finally:
            for router in routers:
                router.stop()
    results = {name: summarize(runs[name], args) for name in names}
    base = results["off"] if "off" in results else None
    print(f"\n{'threshold':>9} {'class':>5} {'TTFT med':>9} {'TPOT med':>9} {'goodput':>8} {'attain':>7} "
          f"{'loose':>6} {'TTFT/off':>9} {'TPOT/off':>9} {'gput/off':>9}  TTFT/off per round")  # fmt: skip
    for name in names:
        for cls in ("short", "long", "all"):
            c = results[name][cls]
            b = base[cls] if base else {}
            c["vs_off"] = {
                "median_ttft": ratio(c["median_ttft_ms"], b.get("median_ttft_ms")),
                "median_tpot": ratio(c["median_tpot_ms"], b.get("median_tpot_ms")),
                "request_goodput": ratio(c["request_goodput"], b.get("request_goodput")),
                "median_ttft_per_round": per_round_ratios(rounds, name, cls, "median_ttft_ms"),
                "median_tpot_per_round": per_round_ratios(rounds, name, cls, "median_tpot_ms"),
            }
            v = c["vs_off"]
            print(f"{name:>9} {cls:>5} {c['median_ttft_ms']:>9.0f} {c['median_tpot_ms'] or 0:>9.1f} "
                  f"{c['request_goodput']:>8.3f} {c['slo_attainment']:>7.2f} {c['loose_slo_attainment']:>6.2f} "
                  f"{v['median_ttft'] or 0:>9.2f} {v['median_tpot'] or 0:>9.2f} {v['request_goodput'] or 0:>9.2f}  "
                  f"{v['median_ttft_per_round']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    summary = {"config": config, "mode": "push 1P1D", "results": results, "rounds": rounds}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
