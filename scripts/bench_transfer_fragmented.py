"""One long request's KV move P -> D on a pre-fragmented pool vs a contiguous one, in one run (push and pull).

    python scripts/bench_transfer_fragmented.py [--shape builtin | --shape qwen3-0.6b] [--tokens 2048]
        [--block-size 16] [--pool-blocks N] [--churn 3000] [--repeat 5] [--modes push,pull]
        [--prefill-gpu -1 --decode-gpu -1] [--out results.json]

CPU (default): the built-in model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32), DRAM
over UCX between two processes. GPU: --shape qwen3-0.6b --tokens 16384 --prefill-gpu 0 --decode-gpu 1 (bf16,
VRAM). Each process is a connector pair driven like the engine drives it, with a block-major KV cache.

Block ids of each repeat, per side:
  contiguous   an idle instance: one run (one descriptor with equal block sizes)
  fragmented   the real BlockPool after random allocate/free churn (requests of 1-300 blocks, prefix-cache
               hashes on every full block, 50-95% occupancy), then the request allocated as the engine does
  lru          the same churn through the previous allocator (one LRU free list), for comparison
  scattered    a random permutation (the worst case)
Descriptors come from layout.descriptors (what the transfer posts); times from the instances' own timeline
events (pull: D transfer_posted -> kv_received; push: P transfer_posted -> D kv_received). D checks its blocks
hold P's bytes (per-block sums). Prints a table and writes JSON; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when pdserve is not installed

from pdserve.engine.block_pool import BlockPool, hash_block  # noqa: E402
from pdserve.kv.decode import decode  # noqa: E402
from pdserve.kv.geometry import CacheGeometry  # noqa: E402
from pdserve.kv.params import encode  # noqa: E402
from pdserve.transfer.base import KVCacheSpec  # noqa: E402
from pdserve.transfer.layout import descriptors, token_segments  # noqa: E402

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
    """The previous allocator: one LRU free list (least recently freed first), for comparison."""

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
def _child(conn: Any, gpu: int, role: str, mode: str, dims: tuple, block_size: int, num_blocks: int) -> None:
    if gpu >= 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from pdserve.config import TransferConfig
    from pdserve.transfer.base import KVCacheSpec
    from pdserve.transfer.factory import make_connectors

    torch.set_num_threads(1)
    layers, heads, head_dim, dtype_name = dims
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if gpu >= 0 else "cpu")
    kv = torch.zeros((num_blocks, layers, 2, heads, block_size, head_dim), dtype=dtype, device=device)
    if role == "prefill":
        kv.normal_()
    cfg = TransferConfig(role=role, mode=mode, side_channel_port=0, engine_id=f"{role}-{os.getpid()}")
    sched, worker = make_connectors(cfg, block_size)
    memory, dev_id = ("VRAM", 0) if gpu >= 0 else ("DRAM", 0)
    geometry = CacheGeometry.of((), layers, heads, head_dim, kv.element_size(), block_size, num_blocks)
    spec = KVCacheSpec(geometry, kv.data_ptr(), memory, dev_id, "bench", dtype_name)
    worker.register_kv_cache(kv, spec)
    worker.start(lambda: None)
    results: dict[str, list] = {"finished_recvs": [], "failed_recvs": [], "finished_sends": [], "events": []}
    params: dict[str, Any] = {}  # request id -> its typed kv_transfer_params until allocation
    conn.send(("ready", sched.info()))
    while True:
        if conn.poll(0.0002):
            cmd, *args = conn.recv()
            reply: Any = None
            if cmd == "shutdown":
                worker.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "needs":  # (request id, kv_transfer_params as JSON), parsed as the server does
                params[args[0]] = decode(args[1])
                reply = sched.needs_remote_kv(args[0], params[args[0]])
            elif cmd == "alloc":
                sched.on_blocks_allocated(*args, params.pop(args[0]))
            elif cmd == "finish":  # -> (keep blocks, the answer's kv_transfer_params as JSON)
                keep = sched.on_request_finished(*args[:3], decode(args[3]))
                answer = sched.take_answer(args[0])
                reply = keep, None if answer is None else encode(answer)
            elif cmd == "results":
                reply = {k: list(v) for k, v in results.items()}
            elif cmd == "block_sums":  # [len(block_ids)] float64 sums over each block
                reply = kv[args[0]].double().sum(dim=(1, 2, 3, 4, 5)).tolist()
            conn.send(("ok", reply))
        meta = sched.build_step_meta()
        if meta:
            worker.submit(meta)
        res = worker.poll_results()
        for k in results:
            results[k].extend(getattr(res, k))


class Proc:
    def __init__(self, ctx: Any, *args: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, *args), daemon=True)
        self.proc.start()
        self.info: dict[str, Any] = {}

    def ready(self) -> Proc:
        if not self.conn.poll(120):
            raise TimeoutError("instance did not start")
        self.info = self.conn.recv()[1]
        return self

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer to {cmd[0]}")
        return self.conn.recv()[1]

    def events(self, rid: str) -> dict[str, float]:
        return {name: t for r, name, t in self.call("results")["events"] if r == rid}

    def wait(self, kind: str, rid: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.call("results")
            if any(x[0] == rid for x in res["failed_recvs"]):
                raise RuntimeError(f"{rid} failed: {res['failed_recvs']}")
            if rid in res[kind]:
                return
            time.sleep(0.001)
        raise TimeoutError(f"{kind} {rid} not within {timeout} s")

    def close(self) -> None:
        try:
            self.call("shutdown", timeout=20)
        except (TimeoutError, EOFError, OSError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def move(mode: str, p: Proc, d: Proc, rid: str, p_blocks: list[int], d_blocks: list[int], tokens: int) -> float:
    """One request's KV P -> D; returns seconds from the post to D noticing the data."""
    if mode == "pull":
        _, params = p.call("finish", f"p-{rid}", p_blocks, tokens, {"do_remote_decode": True})  # KV of `tokens`
        d.call("needs", rid, params)
        d.call("alloc", rid, d_blocks, 0, tokens + 1)
    else:
        info = p.info
        d.call("needs", rid, {"do_remote_prefill": True, "transfer_id": rid, "remote_engine_id": info["engine_id"],
                              "remote_host": info["side_channel_host"], "remote_port": info["side_channel_port"],
                              "tp_size": info["tp_size"], "transfer_mode": "push"})  # fmt: skip
        d.call("alloc", rid, d_blocks, 0, tokens + 1)
        deadline = time.monotonic() + 30
        while "registration_sent" not in d.events(rid) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)  # let the registration reach P: the WRITE then starts at P's finish
        p.call("finish", f"p-{rid}", p_blocks, tokens,
               {"do_remote_decode": True, "transfer_id": rid, "transfer_mode": "push"})  # fmt: skip
    d.wait("finished_recvs", rid)
    p.wait("finished_sends", f"p-{rid}")
    posted = d.events(rid)["transfer_posted"] if mode == "pull" else p.events(f"p-{rid}")["transfer_posted"]
    return d.events(rid)["kv_received"] - posted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="builtin", help="'builtin' or a preset name (qwen3-0.6b, qwen3-8b, ...)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=0, help="blocks per instance (default: 4x the request)")
    ap.add_argument("--churn", type=int, default=3000, help="random allocations/frees before each request")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--kinds", default="contiguous,fragmented,lru,scattered")
    ap.add_argument("--prefill-gpu", type=int, default=-1, help="-1: the CPU (DRAM)")
    ap.add_argument("--decode-gpu", type=int, default=-1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    dims = shape_of(a.shape)
    need = -(-a.tokens // a.block_size)
    a.pool_blocks = a.pool_blocks or 4 * need
    elem = 4 if dims[3] == "float32" else 2
    geometry = CacheGeometry.of((), dims[0], dims[1], dims[2], elem, a.block_size, a.pool_blocks)
    layout = KVCacheSpec(geometry, 0, "DRAM", 0, "bench", dims[3])
    kinds = a.kinds.split(",")
    # block ids per (kind, repeat): P's and D's pools churn with different seeds
    ids = {k: [(block_ids(k, a, need, 2 * i), block_ids(k, a, need, 2 * i + 1)) for i in range(a.repeat + 1)]
           for k in kinds}  # fmt: skip
    ctx = mp.get_context("spawn")
    rows = []
    for mode in a.modes.split(","):
        p = Proc(ctx, a.prefill_gpu, "prefill", mode, dims, a.block_size, a.pool_blocks)
        d = Proc(ctx, a.decode_gpu, "decode", mode, dims, a.block_size, a.pool_blocks)
        try:
            p.ready(), d.ready()
            move(mode, p, d, f"{mode}-warm", list(range(need)), list(range(need)), a.tokens)  # handshake, first use
            for kind in kinds:
                times, descs, alloc_ms, p_runs = [], [], [], []
                for i, ((pb, p_ms), (db, d_ms)) in enumerate(ids[kind][1:]):
                    segs = token_segments(geometry, db, geometry, pb, 0, a.tokens)
                    descs.append(len(descriptors(layout, layout, segs)[0]))
                    alloc_ms.append(max(p_ms, d_ms))
                    p_runs.append(runs(pb))
                    times.append(move(mode, p, d, f"{mode}-{kind}-{i}", pb, db, a.tokens))
                    if i == 0:
                        assert p.call("block_sums", pb) == d.call("block_sums", db), f"{mode} {kind}: bytes differ"
                nbytes = a.tokens * geometry.num_regions * geometry.token_bytes
                med = statistics.median(times)
                rows.append({"mode": mode, "blocks": kind, "tokens": a.tokens, "bytes": nbytes,
                             "descriptors": int(statistics.median(descs)), "p_runs": int(statistics.median(p_runs)),
                             "median_ms": round(med * 1e3, 3), "GB_per_s": round(nbytes / med / 1e9, 2),
                             "best_GB_per_s": round(nbytes / min(times) / 1e9, 2),
                             "allocate_ms": round(statistics.median(alloc_ms), 3)})  # fmt: skip
        finally:
            d.close()
            p.close()
    contiguous = {r["mode"]: r["GB_per_s"] for r in rows if r["blocks"] == "contiguous"}
    print(f"\n{a.shape} shape, {a.tokens} tokens ({rows[0]['bytes'] / 1e6:.1f} MB), blocks of {a.block_size}, "
          f"pool {a.pool_blocks} blocks, churn {a.churn}, {a.repeat} repeats, "
          f"{'GPU' if a.prefill_gpu >= 0 else 'CPU'}")  # fmt: skip
    print(f"{'mode':5} {'blocks':11} {'descs':>6} {'P runs':>6} {'median ms':>10} {'GB/s':>7} {'vs contig':>9} "
          f"{'alloc ms':>8}")  # fmt: skip
    for r in rows:
        rel = r["GB_per_s"] / contiguous[r["mode"]] if contiguous.get(r["mode"]) else float("nan")
        r["vs_contiguous"] = round(rel, 3)
        print(f"{r['mode']:5} {r['blocks']:11} {r['descriptors']:6d} {r['p_runs']:6d} {r['median_ms']:10.2f} "
              f"{r['GB_per_s']:7.2f} {rel:9.2f} {r['allocate_ms']:8.3f}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": a.shape, "date": time.strftime("%Y-%m-%d"), "block_size": a.block_size,
                       "pool_blocks": a.pool_blocks, "churn": a.churn, "repeat": a.repeat,
                       "device": "gpu" if a.prefill_gpu >= 0 else "cpu",
                       "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
