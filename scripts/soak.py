"""Soak: thousands of mixed requests through a 1P1D deployment per mode, at and past capacity, with aborts.

    python scripts/soak.py [--model smollm2-135m] [--modes push,pull] [--requests 2000] [--report-every 500]
                           [--concurrency 8,48] [--abort-fraction 0.1] [--out soak.json]

Per mode, one deployment (pdserve.bench.deploy: P + D + router, a fresh deployment secret, each server with
--max-inflight-requests 24 so that the second concurrency level is past capacity). The requests mix prompts
from a fixed pool, max_tokens 1-16 with ignore_eos, streamed and not; a fraction is aborted by the client after
a random 0-300 ms. Every answer that completes (200) is checked token for token against D's own colocated
greedy answer for that prompt (D serves a request without kv_transfer_params by prefilling it itself), cut to
the answer's length. After each concurrency level: both instances must come back to free == total blocks.
Each level runs in rounds of --report-every requests; after each round: wrong answers (must be 0), leaked
blocks (must be 0, both instances idle), 5xx other than 503, 503s (overload, with Retry-After), aborts, and
each server's resident memory (VmRSS), so growth per round tells a leak (growing every round) from a one-time
peak (flat after warm-up). Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.scrape import scrape_metrics

WORDS = "the a cat dog ran over under quick brown lazy fox river city night morning sang wrote".split()
MAX_TOKENS = 16


def prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))) for _ in range(num)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_free(url: str, timeout_s: float = 60.0) -> int:
    """Blocks not free after the instance went idle (0 = nothing leaked), waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        leaked = int(m["pdserve_kv_blocks_total"] - m["pdserve_kv_blocks_free"])
        if leaked == 0 or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


async def one(client: httpx.AsyncClient, url: str, prompt: str, rng: random.Random, abort_p: float) -> dict:
    body = {"prompt": prompt, "max_tokens": rng.randint(1, MAX_TOKENS), "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": rng.random() < 0.5}  # fmt: skip
    abort_after = rng.uniform(0, 0.3) if rng.random() < abort_p else None

    async def call() -> dict:
        if not body["stream"]:
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                return {"status": r.status_code, "retry_after": r.headers.get("Retry-After")}
            return {"status": 200, "tokens": r.json()["choices"][0]["token_ids"]}
        tokens: list[int] = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "retry_after": r.headers.get("Retry-After")}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": 500, "error": chunk["error"]}
                    for choice in chunk.get("choices", []):
                        tokens += choice.get("token_ids") or []
        return {"status": 200, "tokens": tokens}

    task = asyncio.ensure_future(call())
    if abort_after is not None:
        done, _ = await asyncio.wait({task}, timeout=abort_after)
        if not done:
            task.cancel()
            return {"status": "aborted", "prompt": prompt}
    try:
        out = await task
    except httpx.HTTPError as e:
        out = {"status": "transport", "error": str(e)}
    out["prompt"] = prompt
    out["max_tokens"] = body["max_tokens"]
    return out


async def level(url: str, pool: list[str], num: int, concurrency: int, abort_p: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def gated(i: int) -> dict:
            async with sem:
                return await one(client, url, pool[rng.randrange(len(pool))], random.Random(seed * 100003 + i),
                                 abort_p)  # fmt: skip

        return await asyncio.gather(*(gated(i) for i in range(num)))


def reference(decode_url: str, pool: list[str]) -> dict[str, list[int]]:
    """D's own greedy tokens for each prompt (no kv_transfer_params: D prefills it)."""
    ref = {}
    with httpx.Client(timeout=600, trust_env=False) as client:
        for p in pool:
            body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            ref[p] = client.post(decode_url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
    return ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--requests", type=int, default=2000, help="requests per concurrency level per mode")
    ap.add_argument("--report-every", type=int, default=500, help="requests per round (one row, RSS read after it)")
    ap.add_argument("--concurrency", default="8,48", help="comma-separated levels (the last is past capacity)")
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    pool = prompts(24, a.seed)
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    options = ServerOptions(a.model, num_threads=a.num_threads, extra_args=("--max-inflight-requests", "24"))
    for mode in a.modes.split(","):
        with Deployment(options, mode, log_dir) as dep:
            ref = reference(dep.decode_url, pool)
            servers = {p.name: p for p in dep.procs if p.name in ("prefill", "decode")}
            rss_start = {name: round(rss_mib(p.pid), 1) for name, p in servers.items()}
            rounds = [(conc, r) for conc in (int(c) for c in a.concurrency.split(","))
                      for r in range(0, a.requests, a.report_every)]  # fmt: skip
            for conc, first in rounds:
                num = min(a.report_every, a.requests - first)
                started = time.monotonic()
                seed = a.seed + conc * 1000003 + first
                results = asyncio.run(level(dep.router_url, pool, num, conc, a.abort_fraction, seed))
                seconds = time.monotonic() - started
                ok = [r for r in results if r["status"] == 200]
                wrong = [r for r in ok if r["tokens"] != ref[r["prompt"]][: len(r["tokens"])]
                         or len(r["tokens"]) != r["max_tokens"]]  # fmt: skip
                leaked = {name: wait_free(url) for name, url in (("prefill", dep.prefill_url),
                                                                  ("decode", dep.decode_url))}  # fmt: skip
                row = {
                    "mode": mode, "concurrency": conc, "first": first, "requests": len(results),
                    "seconds": round(seconds, 1),
                    "ok": len(ok), "wrong": len(wrong),
                    "aborted": sum(r["status"] == "aborted" for r in results),
                    "busy_503": sum(r["status"] == 503 for r in results),
                    "retry_after_on_503": all(r.get("retry_after") for r in results if r["status"] == 503),
                    "other_errors": sum(r["status"] not in (200, 503, "aborted") for r in results),
                    "other_statuses": sorted({str(r["status"]) for r in results} - {"200", "503", "aborted"}),
                    "leaked_blocks": leaked,
                    "rss_mib_start": rss_start,
                    "rss_mib_end": {name: round(rss_mib(p.pid), 1) for name, p in servers.items()},
                }  # fmt: skip
                rows.append(row)
                rss_start = row["rss_mib_end"]  # the next round's growth is its own
                print(json.dumps(row), flush=True)
                if wrong:
                    print("first wrong answer:", json.dumps(wrong[0])[:500], flush=True)
    print(f"\n{'mode':5} {'conc':>4} {'after':>5} {'ok':>5} {'wrong':>5} {'abort':>5} {'503':>5} {'other':>5} "
          f"{'leaked P/D':>10} {'RSS P start->end MiB':>21} {'RSS D start->end':>17}")  # fmt: skip
    for r in rows:
        lp, ld = r["leaked_blocks"]["prefill"], r["leaked_blocks"]["decode"]
        rp = f"{r['rss_mib_start']['prefill']}->{r['rss_mib_end']['prefill']}"
        rd = f"{r['rss_mib_start']['decode']}->{r['rss_mib_end']['decode']}"
        lease = f"{lp}/{ld}"
        print(f"{r['mode']:5} {r['concurrency']:4d} {r['first'] + r['requests']:5d} {r['ok']:5d} {r['wrong']:5d} "
              f"{r['aborted']:5d} {r['busy_503']:5d} {r['other_errors']:5d} {lease:>10} {rp:>21} {rd:>17}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "date": time.strftime("%Y-%m-%d"), "rows": rows,
                       "logs": str(log_dir)}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
