"""One request's KV move P -> D through pdserve's connectors (push and pull), per block layout, on the CPU or GPUs.

    python scripts/bench_transfer.py [--shape builtin | --shape qwen3-0.6b] [--tokens 2048] [--block-size 16]
        [--pool-blocks N] [--churn 3000] [--repeat 5] [--modes push,pull]
        [--kinds contiguous,fragmented,lru,scattered] [--prefill-gpu -1 --decode-gpu -1] [--out results.json]
    python scripts/bench_transfer.py --thread-cpu     # what one transfer thread costs a core, idle and hot

CPU (default): the built-in model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32), DRAM
over UCX between two processes. GPU: --shape qwen3-0.6b --tokens 16384 --prefill-gpu 0 --decode-gpu 1 (bf16,
VRAM; the same GPU twice puts P and D on one device). Each process is a connector pair driven like the engine
drives it (pdserve/testing/transfer_pair.py), with a block-major KV cache.

Block ids of each repeat, per side:
  contiguous   an idle instance: one run (one descriptor with equal block sizes)
  fragmented   the real BlockPool after random allocate/free churn (requests of 1-300 blocks, prefix-cache
               hashes on every full block, 50-95% occupancy), then the request allocated as the engine does
  lru          the same churn through an allocator with one LRU free list, for comparison
  scattered    a random permutation (the worst case)
Descriptors come from layout.descriptors (what the transfer posts). Times from the instances' own timeline
events: "transfer" from the READ/WRITE posted (pull: D's event, push: P's) to D's kv_received; "ready" from the
driver's last hand-over (pull: D's allocation, push: P's finished prefill) to the same. D checks its blocks hold
P's bytes (per-block sums) on the first repeat of each kind. Prints a table and writes JSON; asserts nothing
about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import OrderedDict
from typing import Any

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.kv.geometry import CacheGeometry
from pdserve.testing.transfer_pair import Instance, close_all, move, start_all
from pdserve.transfer.base import KVCacheSpec
from pdserve.transfer.layout import descriptors, token_segments

BUILTIN = (30, 3, 64, "float32")  # layers, kv heads, head dim, dtype of the built-in model (SmolLM2-135M)


def shape_of(name: str) -> tuple[int, int, int, str]:
    if name == "builtin":
        return BUILTIN
    from pdserve.model.arch import ModelArch
    from pdserve.model.presets import get_preset

    arch = ModelArch.from_hf_config(get_preset(name))
    return arch.num_layers, arch.num_kv_heads, arch.head_dim, "bfloat16"


# ---- block ids after churn -----------------------------------------------------------------------------------
class LruPool:
    """An allocator with one LRU free list (least recently freed first), for comparison."""

    def __init__(self, num_blocks: int) -> None:
        self.free_list: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list[int]:
        return [self.free_list.popitem(last=False)[0] for _ in range(n)]

    def free(self, ids: Any) -> None:
        for b in ids:
            self.free_list[b] = None


def churned_blocks(pool_cls: str, num_blocks: int, need: int, churn: int, seed: int) -> tuple[list[int], float]:
    """Block ids of a `need`-block request after `churn` random allocations/frees; (ids, ms to allocate them)."""
    rng = random.Random(seed)
    pool: Any = BlockPool(num_blocks) if pool_cls == "pool" else LruPool(num_blocks)
    live: list[list[int]] = []
    tag = 0
    for _ in range(churn):
        occupancy = 1 - pool.num_free / num_blocks
        if live and (occupancy > 0.95 or (occupancy > 0.5 and rng.random() < 0.5)):
            pool.free(reversed(live.pop(rng.randrange(len(live)))))
            continue
        n = min(rng.randint(1, 300), pool.num_free)
        ids: list[int] = []
        while len(ids) < n:  # grown in chunks, as prefill chunks and decode steps grow a request
            k = min(n - len(ids), rng.choice((1, 1, 8, 64, 256)))
            ids += pool.allocate(k, after=ids[-1] if ids else None) if pool_cls == "pool" else pool.allocate(k)
        if pool_cls == "pool":
            parent = None
            for b in ids[: len(ids) - 1]:  # full blocks enter the prefix cache
                tag += 1
                parent = hash_block(parent, [tag])
                pool.cache(b, parent)
        live.append(ids)
    while pool.num_free < need:
        pool.free(reversed(live.pop(rng.randrange(len(live)))))
    t0 = time.perf_counter()
    got = pool.allocate(need)
    return got, (time.perf_counter() - t0) * 1e3


def block_ids(kind: str, a: argparse.Namespace, need: int, seed: int) -> tuple[list[int], float]:
    if kind == "contiguous":
        return list(range(seed % 2 * 4, seed % 2 * 4 + need)), 0.0
    if kind == "scattered":
        return random.Random(seed).sample(range(a.pool_blocks), need), 0.0
    return churned_blocks("pool" if kind == "fragmented" else "lru", a.pool_blocks, need, a.churn, seed)


def runs(ids: list[int]) -> int:
    return 1 + sum(1 for x, y in zip(ids, ids[1:], strict=False) if y != x + 1)


# ---- the two processes ---------------------------------------------------------------------------------------
def instance(role: str, mode: str, gpu: int, dims: tuple[int, int, int, str], a: argparse.Namespace) -> Instance:
    env = {"CUDA_VISIBLE_DEVICES": str(gpu), "OMP_NUM_THREADS": "1"} if gpu >= 0 else {"OMP_NUM_THREADS": "1"}
    return Instance(role, mode, block_size=a.block_size, num_blocks=a.pool_blocks, model="bench", dims=dims[:3],
                    env=env, device="cuda" if gpu >= 0 else "cpu", dtype=dims[3],
                    fill="random" if role == "prefill" else "empty")  # fmt: skip


def measure(a: argparse.Namespace) -> list[dict[str, Any]]:
    dims = shape_of(a.shape)
    need = -(-(a.tokens + 1) // a.block_size)  # the prompt: D computes its last token itself
    a.pool_blocks = a.pool_blocks or 4 * need
    elem = 4 if dims[3] == "float32" else 2
    geometry = CacheGeometry.of((), dims[0], dims[1], dims[2], elem, a.block_size, a.pool_blocks)
    layout = KVCacheSpec(geometry, 0, "DRAM", 0, "bench", dims[3])
    kinds = a.kinds.split(",")
    # block ids per (kind, repeat): P's and D's pools churn with different seeds
    ids = {k: [(block_ids(k, a, need, 2 * i), block_ids(k, a, need, 2 * i + 1)) for i in range(a.repeat + 1)]
           for k in kinds}  # fmt: skip
    rows = []
    for mode in a.modes.split(","):
        insts = start_all(p=instance("prefill", mode, a.prefill_gpu, dims, a),
                          d=instance("decode", mode, a.decode_gpu, dims, a))  # fmt: skip
        p, d = insts["p"], insts["d"]
        try:
            move(mode, p, d, f"{mode}-warm", list(range(need)), list(range(need)), a.tokens)  # handshake, first use
            for kind in kinds:
                times, ready, descs, alloc_ms, p_runs = [], [], [], [], []
                for i, ((pb, p_ms), (db, d_ms)) in enumerate(ids[kind][1:]):
                    segs = token_segments(geometry, db, geometry, pb, 0, a.tokens)
                    descs.append(len(descriptors(layout, layout, segs)[0]))
                    alloc_ms.append(max(p_ms, d_ms))
                    p_runs.append(runs(pb))
                    transfer_s, ready_s = move(mode, p, d, f"{mode}-{kind}-{i}", pb, db, a.tokens)
                    times.append(transfer_s)
                    ready.append(ready_s)
                    if i == 0:  # the blocks holding the moved tokens (a partial last one moves whole)
                        moved = -(-a.tokens // a.block_size)
                        same = p.call("block_sums", pb[:moved]) == d.call("block_sums", db[:moved])
                        assert same, f"{mode} {kind}: D's blocks differ from P's"
                nbytes = a.tokens * geometry.num_regions * geometry.token_bytes
                med = statistics.median(times)
                rows.append({"mode": mode, "blocks": kind, "tokens": a.tokens, "bytes": nbytes,
                             "descriptors": int(statistics.median(descs)), "p_runs": int(statistics.median(p_runs)),
                             "median_ms": round(med * 1e3, 3), "GB_per_s": round(nbytes / med / 1e9, 2),
                             "best_GB_per_s": round(nbytes / min(times) / 1e9, 2),
                             "ready_ms": round(statistics.median(ready) * 1e3, 3),
                             "allocate_ms": round(statistics.median(alloc_ms), 3)})  # fmt: skip
        finally:
            close_all({"d": d, "p": p})  # D first: P going first reads as a dead peer to D
    return rows


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    contiguous = {r["mode"]: r["GB_per_s"] for r in rows if r["blocks"] == "contiguous"}
    print(f"\n{a.shape} shape, {a.tokens} tokens ({rows[0]['bytes'] / 1e6:.1f} MB), blocks of {a.block_size}, "
          f"pool {a.pool_blocks} blocks, churn {a.churn}, {a.repeat} repeats, "
          f"{'GPU' if a.prefill_gpu >= 0 else 'CPU'}")  # fmt: skip
    print(f"{'mode':5} {'blocks':11} {'descs':>6} {'P runs':>6} {'median ms':>10} {'GB/s':>7} {'vs contig':>9} "
          f"{'ready ms':>9} {'alloc ms':>8}")  # fmt: skip
    for r in rows:
        rel = r["GB_per_s"] / contiguous[r["mode"]] if contiguous.get(r["mode"]) else float("nan")
        r["vs_contiguous"] = round(rel, 3)
        print(f"{r['mode']:5} {r['blocks']:11} {r['descriptors']:6d} {r['p_runs']:6d} {r['median_ms']:10.2f} "
              f"{r['GB_per_s']:7.2f} {rel:9.2f} {r['ready_ms']:9.2f} {r['allocate_ms']:8.3f}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": a.shape, "date": time.strftime("%Y-%m-%d"), "block_size": a.block_size,
                       "pool_blocks": a.pool_blocks, "churn": a.churn, "repeat": a.repeat,
                       "device": "gpu" if a.prefill_gpu >= 0 else "cpu",
                       "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "rows": rows}, f, indent=1)  # fmt: skip


def thread_cpu(seconds: float = 5.0) -> None:
    """CPU of one worker's threads in this process: idle (waits of the idle poll) and hot (a pinned pull send:
    50 us polls)."""
    import torch

    from pdserve.config import TransferConfig
    from pdserve.kv.params import RemoteDecode
    from pdserve.transfer.factory import make_connectors

    sched, worker = make_connectors(TransferConfig(role="prefill", mode="pull", side_channel_port=0, lease_s=100), 16)
    kv = torch.zeros(16, 2, 2, 2, 16, 4)  # [blocks, layers, 2, heads, block_size, head_dim]
    geometry = CacheGeometry.of((), 2, 2, 4, 4, 16, 16)
    worker.register_kv_cache(kv, KVCacheSpec(geometry, kv.data_ptr(), "DRAM", 0, "m", "float32"))
    worker.start(lambda: None)

    def share() -> float:
        t0, c0 = time.time(), time.process_time()
        time.sleep(seconds)
        return 100 * (time.process_time() - c0) / (time.time() - t0)

    time.sleep(0.5)
    idle = share()
    sched.on_request_finished("r", [0], 4, RemoteDecode(None, None))
    worker.submit(sched.build_step_meta())
    hot = share()
    worker.shutdown()
    print(f"transfer thread: idle {idle:.1f}% of one core, hot {hot:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="builtin", help="'builtin' or a preset name (qwen3-0.6b, qwen3-8b, ...)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens moved (the prompt is one longer)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=0, help="blocks per instance (default: 4x the request)")
    ap.add_argument("--churn", type=int, default=3000, help="random allocations/frees before each request")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--kinds", default="contiguous,fragmented,lru,scattered")
    ap.add_argument("--prefill-gpu", type=int, default=-1, help="-1: the CPU (DRAM)")
    ap.add_argument("--decode-gpu", type=int, default=-1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--thread-cpu", action="store_true", help="measure one transfer thread's CPU cost instead")
    a = ap.parse_args()
    if a.thread_cpu:
        thread_cpu()
    else:
        report(a, measure(a))


if __name__ == "__main__":
    main()
