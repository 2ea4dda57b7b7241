"""Where pull's relay and "router -> P" go at long prompts: each step between the client's send and P's engine
taking the request, and between P's first token and D's READ, from the router's and the instances' timelines
(pdserve/bench/phase_split.py names the steps).

Usage: .venv/bin/python scripts/relay_split.py [--input-len 16384] [--requests 8] [--model tiny]
       .venv/bin/python scripts/relay_split.py --timeline docs/results/.../timeline_pull.json   (a saved sweep)

Starts one pull 1P1D deployment + router on this machine (pdserve.bench.deploy, with a deployment secret, so
capabilities are issued and checked as in production) and sends sequential streamed completions of fresh random
token ids, one output token after P's (max_tokens 2), then reads GET /timeline from the router, P and D. The
relay is CPU work independent of the model: `--model tiny` (the default) is a 2-layer qwen3-shaped model with
Qwen3's vocabulary and dummy weights, so its ids are as long in JSON as a real prompt's and its prefill is
short on a CPU. Any other value is passed to `pdserve serve` as the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import aiohttp
import httpx

from pdserve.bench.client import ClientConfig, send_request
from pdserve.bench.dataset import SampleRequest
from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.phase_split import SPLITS, label, split_medians, split_table
from pdserve.bench.timeline import join, load_saved, save

TINY = {  # qwen3's vocabulary (its ids' JSON length), two narrow layers: a 16k prefill takes ~a second on a CPU
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 40960,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "vocab_size": 151936,
}


def _timeline(url: str) -> list[dict]:
    return httpx.get(url + "/timeline", timeout=30, trust_env=False).json()


async def _send_all(router_url: str, args: argparse.Namespace) -> dict[str, float]:
    """Sequential streamed requests through the bench's client (as `pdserve sweep` sends them): request id -> the
    unix time each was sent (warm-ups left out)."""
    rng = random.Random(args.seed)
    model = httpx.get(router_url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    cfg = ClientConfig(router_url + "/v1/completions", model, is_chat=False, ignore_eos=True)
    sent = {}
    async with aiohttp.ClientSession() as session:
        for i in range(args.warmups + args.requests):
            prompt = [rng.randrange(1000, 150000) for _ in range(args.input_len)]
            req = SampleRequest(f"split-{i}-{uuid.uuid4().hex[:8]}", prompt, args.input_len, 2)
            out = await send_request(session, cfg, req)
            if out.error:
                raise RuntimeError(f"{req.request_id}: {out.error}")
            if i >= args.warmups:
                sent[req.request_id] = out.start_time
            print(f"  {req.request_id}: TTFT {1000 * out.ttft:.1f} ms", file=sys.stderr)
            await asyncio.sleep(args.gap_s)
    return sent


def measure(args: argparse.Namespace, workdir: Path) -> list[tuple]:
    model = args.model
    load_format = None
    if model == "tiny":
        folder = workdir / "tiny-qwen3"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(TINY))
        model, load_format = str(folder), "dummy"
    options = ServerOptions(
        model,
        load_format=load_format,
        num_threads=args.num_threads,
        max_model_len=args.input_len + 64,
        extra_args=tuple(args.server_arg),
    )
    with Deployment(options, "pull", workdir / "logs") as dep:
        print(f"pull deployment up: router {dep.router_url}", file=sys.stderr)
        sent = asyncio.run(_send_all(dep.router_url, args))
        entries = [_timeline(url) for url in (dep.prefill_url, dep.decode_url, dep.router_url)]
    if args.save is not None:
        sent_ids = set(sent)
        kept = [[e for e in es if (e.get("client_request_id") or e["request_id"]) in sent_ids] for es in entries]
        save(args.save, "pull", *kept)
        print(f"timeline written to {args.save}", file=sys.stderr)
    timelines = join(*entries)
    return [(tl, {"sent": sent[tl.request_id]}) for tl in timelines if tl.request_id in sent]


def totals(pairs: list[tuple]) -> str:
    """Each split phase end to end per request (first event of its chain to the last): median (min, max) ms."""
    lines = []
    for phase, chain in SPLITS["pull"].items():
        ends = [chain[0] if chain[0][0] != "C" else chain[1], chain[-1]]
        values = sorted(
            1000 * (t1 - t0)
            for tl, _ in pairs
            if (t0 := tl.event(*ends[0])) is not None and (t1 := tl.event(*ends[1])) is not None
        )
        if values:
            span = f"{label(ends[0])} -> {label(ends[1])}"
            median = statistics.median(values)
            lines.append(
                f"{phase} per request, {span}: median {median:.2f} ms (min {values[0]:.2f}, max {values[-1]:.2f})"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap-s", type=float, default=0.5, help="pause between requests (the servers go idle)")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to both instances (repeat)")
    ap.add_argument("--save", type=Path, default=None, help="write the run's timeline here (for `pdserve timeline`)")
    ap.add_argument("--timeline", type=Path, default=None, help="a saved pull timeline instead of a run")
    args = ap.parse_args()
    if args.timeline is not None:
        mode, timelines = load_saved(args.timeline)
        pairs = [(tl, {}) for tl in timelines]
        print(split_table(mode, split_medians(mode, pairs)))
        print(totals(pairs))
        return
    with tempfile.TemporaryDirectory(prefix="relay-split-") as tmp:
        pairs = measure(args, Path(tmp))
    print(f"{len(pairs)} requests of {args.input_len} token ids, model {args.model}")
    print(split_table("pull", split_medians("pull", pairs)))
    print(totals(pairs))


if __name__ == "__main__":
    main()
