"""NIXL descriptors one request's KV transfer posts, per tensor-parallel mapping: this tree's layout.py against a
baseline revision's (default: 1fda30d, the last with tokens before heads in a block). Pure layout math, no NIXL.

    python scripts/count_descriptors.py [--baseline 1fda30d] [--tokens 2048,16384] [--seed 0] [--out counts.json]

Shape: Qwen3-32B (64 layers, 8 KV heads, head dim 128, bf16), blocks of 16 tokens. A prompt of N tokens moves
N - 1 (D computes the last prompt token itself), built as the transfer thread builds it (push_write.py, pull.py):
group_segments, then pad_last_blocks where this tree has it, then descriptors per (D rank, producer rank) pair
with that pair's head slice (heads.py). Block ids are a random permutation on each side ("scattered", the worst
case; what a fragmented pool approaches) and, for equal TP, also one run per side ("contiguous", an idle pool).
Prints the total over every pair and the largest single transfer (what one post carries); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer import layout as new_layout
from pdserve.transfer.base import KVCacheSpec
from pdserve.transfer.heads import rank_heads, sources

LAYERS, KV_HEADS, HEAD_DIM, ELEM, BLOCK = 64, 8, 128, 2, 16  # Qwen3-32B, bf16
MAPPINGS = [(8, 4), (2, 1), (1, 2), (8, 8), (1, 1)]  # (P TP, D TP)


def baseline_layout(rev: str) -> types.ModuleType:
    """layout.py as of `rev`, loaded as its own module (it imports only pure modules this tree still has)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:pdserve/transfer/layout.py"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    src = src.replace("pdserve.model.kv_groups", "pdserve.kv.groups")  # moved since (issue 27)
    mod = types.ModuleType(f"layout_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:pdserve/transfer/layout.py", "exec"), mod.__dict__)
    return mod


def cache(lay: types.ModuleType, base: int, heads: int) -> Any:
    """One rank's cache in `lay`'s terms: a BlockLayout (an older layout.py) or a KVCacheSpec (this tree's)."""
    if hasattr(lay, "BlockLayout"):
        return lay.BlockLayout(base, LAYERS, 1 << 16, BLOCK, heads * HEAD_DIM * ELEM, 0, heads)
    geometry = CacheGeometry.of((), LAYERS, heads, HEAD_DIM, ELEM, BLOCK, 1 << 16)
    return KVCacheSpec(geometry, base, "DRAM", 0, "m", "bfloat16")


def count(lay: types.ModuleType, p_tp: int, d_tp: int, tokens: int, ids: Callable[[int, int], list[int]]) -> dict:
    """Descriptors over every (D rank, producer rank) pair of one request, and the largest pair's."""
    moved = tokens - 1
    nblk = -(-tokens // BLOCK)
    total, largest, nbytes, seconds = 0, 0, 0, 0.0
    for d_rank in range(d_tp):
        _, d_heads = rank_heads(KV_HEADS, d_tp, d_rank)
        local = cache(lay, 1 << 40, d_heads)
        d_ids = ids(nblk, 2 * d_rank + 1)
        for s in sources(KV_HEADS, p_tp, d_tp, d_rank):
            _, p_heads = rank_heads(KV_HEADS, p_tp, s.producer_rank)
            remote = cache(lay, 1 << 41, p_heads)
            lg, rg = (local, remote) if hasattr(lay, "BlockLayout") else (local.geometry, remote.geometry)
            started = time.perf_counter()
            segs = lay.group_segments(lg, [d_ids], rg, [ids(nblk, 2 * s.producer_rank)], [None], 0, moved)
            if hasattr(lay, "pad_last_blocks"):
                segs = lay.pad_last_blocks(lg, rg, segs)
            lo, _ = lay.descriptors(local, remote, segs, lay.Heads(s.consumer_offset, s.producer_offset, s.num_heads))
            seconds += time.perf_counter() - started
            total, largest, nbytes = total + len(lo), max(largest, len(lo)), nbytes + int(lo[:, 1].sum())
    return {"descriptors": total, "largest_transfer": largest, "bytes": nbytes, "build_ms": round(seconds * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="1fda30d", help="git revision whose layout.py is the 'old' column")
    ap.add_argument("--tokens", default="2048,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    old_layout = baseline_layout(a.baseline)

    def scattered(n: int, salt: int) -> list[int]:
        return random.Random(a.seed * 1000 + salt).sample(range(1 << 16), n)

    def contiguous(n: int, salt: int) -> list[int]:
        return list(range(salt * n, (salt + 1) * n))

    rows = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        for p_tp, d_tp in MAPPINGS:
            for blocks, ids in (("scattered", scattered), ("contiguous", contiguous)):
                if blocks == "contiguous" and p_tp != d_tp:
                    continue  # a head slice is one range per (block, layer, K/V) whatever the block order
                old = count(old_layout, p_tp, d_tp, tokens, ids)
                new = count(new_layout, p_tp, d_tp, tokens, ids)
                rows.append({"tokens": tokens, "p_tp": p_tp, "d_tp": d_tp, "blocks": blocks, "old": old, "new": new})
    print(f"Qwen3-32B shape ({LAYERS} layers, {KV_HEADS} KV heads, head dim {HEAD_DIM}, bf16), blocks of {BLOCK}; "
          f"old = {a.baseline}'s layout.py, new = this tree's. Descriptors over every (D rank, P rank) pair; "
          f"'largest' = one transfer's")  # fmt: skip
    print(f"{'tokens':>6} {'P TP':>4} {'D TP':>4} {'blocks':10} {'old descs':>10} {'new descs':>10} {'ratio':>7} "
          f"{'old largest':>11} {'new largest':>11} {'old ms':>7} {'new ms':>7} {'new/old bytes':>13}")  # fmt: skip
    for r in rows:
        o, n = r["old"], r["new"]
        print(f"{r['tokens']:6d} {r['p_tp']:4d} {r['d_tp']:4d} {r['blocks']:10} {o['descriptors']:10d} "
              f"{n['descriptors']:10d} {o['descriptors'] / n['descriptors']:7.1f} {o['largest_transfer']:11d} "
              f"{n['largest_transfer']:11d} {o['build_ms']:7.1f} {n['build_ms']:7.1f} "
              f"{n['bytes'] / o['bytes']:13.4f}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
