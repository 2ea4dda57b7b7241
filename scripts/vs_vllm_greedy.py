"""Greedy correctness against a peer: send the same token-id prompts to one OpenAI-compatible server, save outputs.

    python scripts/vs_vllm_greedy.py query --base-url URL --model NAME --out FILE.json
    python scripts/vs_vllm_greedy.py compare A.json B.json

Prompts are built deterministically (seeded): unique per request (no prefix-cache shortcut), several lengths,
half of them natural text (a distinct numbered sentence in front of a shared passage), half random ids.
Each request: temperature 0, max_tokens 32, ignore_eos, return_token_ids (texts are compared when a server
gives no token ids). Only the standard library is used, so any venv runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request

LENGTHS = (7, 33, 128, 300, 511, 1000)
VOCAB = 49152  # SmolLM2
MAX_TOKENS = 32


def prompts(text_ids: list[int] | None) -> list[list[int]]:
    """Two prompts per length: one random-id prompt and one text-derived prompt (or a second random one)."""
    rng = random.Random(1234)
    out: list[list[int]] = []
    for i, n in enumerate(LENGTHS):
        out.append([rng.randrange(100, VOCAB) for _ in range(n)])
        if text_ids:
            # unique head (a few random ids) + a window of natural text so the continuation is meaningful
            head = [rng.randrange(100, VOCAB) for _ in range(3)]
            start = (i * 97) % max(1, len(text_ids) - n)
            body = (text_ids * (1 + n // max(1, len(text_ids))))[start : start + n - 3]
            out.append(head + body)
        else:
            out.append([rng.randrange(100, VOCAB) for _ in range(n)])
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def query(args: argparse.Namespace) -> None:
    text_ids = json.load(open(args.text_ids)) if args.text_ids else None
    results = []
    for p in prompts(text_ids):
        body = {
            "model": args.model,
            "prompt": p,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        t0 = time.perf_counter()
        r = post(f"{args.base_url}/v1/completions", body)
        c = r["choices"][0]
        results.append(
            {
                "prompt_len": len(p),
                "token_ids": c.get("token_ids"),
                "text": c["text"],
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
    json.dump(results, open(args.out, "w"), indent=1)
    print(f"{len(results)} prompts -> {args.out}")


def compare(args: argparse.Namespace) -> None:
    a, b = json.load(open(args.a)), json.load(open(args.b))
    assert len(a) == len(b)
    match = 0
    rows = []
    for x, y in zip(a, b, strict=True):
        if x["token_ids"] is not None and y["token_ids"] is not None:
            same, kind = x["token_ids"] == y["token_ids"], "ids"
            pairs = zip(x["token_ids"], y["token_ids"], strict=False)  # lengths may differ: the first mismatch
            first = next((i for i, (s, t) in enumerate(pairs) if s != t), None)
        else:
            same, kind, first = x["text"] == y["text"], "text", None
        match += same
        rows.append({"prompt_len": x["prompt_len"], "equal": same, "compared": kind, "first_diff": first})
        print(f"len {x['prompt_len']:5d}  {kind:4s}  {'EQUAL' if same else 'DIFF at ' + str(first)}")
    print(f"greedy match: {match}/{len(a)}")
    if args.out:
        json.dump({"matches": match, "total": len(a), "rows": rows}, open(args.out, "w"), indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query")
    q.add_argument("--base-url", required=True)
    q.add_argument("--model", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--text-ids", default=None, help="JSON list of token ids of a natural passage")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--out", default=None)
    args = ap.parse_args()
    query(args) if args.cmd == "query" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
