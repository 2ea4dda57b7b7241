"""Effective bandwidth of one request's KV move P -> D through pdserve's connectors (push and pull), on GPUs.

    python scripts/bench_transfer.py [--model qwen3-0.6b] [--tokens 16384] [--repeat 5] [--modes push,pull]
                                     [--prefill-gpu 0 --decode-gpu 1] [--out results.json]

Two processes, each a connector pair (scheduler + worker side, driven like the engine drives them) with a
bf16 KV cache of the model's shape in VRAM (KVCacheSpec.memory = "VRAM"), P on --prefill-gpu and D on
--decode-gpu; NIXL over UCX moves the blocks GPU to GPU. P's cache is random; after every move D checks
that its blocks hold P's bytes (per-block sums). Block ids are contiguous (an idle instance's free list:
one descriptor after merging) and scattered (a random permutation: one per block, the cache being block-major).
scripts/bench_transfer_fragmented.py measures blocks as the pool hands them out after churn.
Times come from the instances' own timeline events (time.time(), one host):
  pull: D "transfer_posted" -> D "kv_received" (the READ, handshake cached after the first request)
  push: P "transfer_posted" -> D "kv_received" (WRITE + completion notification + D noticing it)
Effective GB/s = KV bytes / that time; compare with raw NIXL VRAM WRITE (230-274 GB/s on nvidia-h200-x2).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any


def _child(conn: Any, gpu: int, role: str, mode: str, model: str, block_size: int, num_blocks: int) -> None:
    if gpu >= 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import torch

    from pdserve.config import TransferConfig
    from pdserve.engine.kv_cache import allocate_kv_cache, kv_cache_spec
    from pdserve.kv.decode import decode
    from pdserve.kv.params import encode
    from pdserve.model.arch import ModelArch
    from pdserve.model.presets import get_preset
    from pdserve.transfer.factory import make_connectors

    arch = ModelArch.from_hf_config(get_preset(model))
    kv = allocate_kv_cache(arch, num_blocks, block_size, torch.bfloat16, torch.device("cuda" if gpu >= 0 else "cpu"))
    if role == "prefill":
        kv.normal_()
    cfg = TransferConfig(role=role, mode=mode, side_channel_port=0, engine_id=f"{role}-{os.getpid()}")
    sched, worker = make_connectors(cfg, block_size)
    worker.register_kv_cache(kv, kv_cache_spec(kv, model, "bfloat16"))
    worker.start(lambda: None)
    results: dict[str, list] = {"finished_recvs": [], "failed_recvs": [], "finished_sends": [], "events": []}
    sources: dict[str, Any] = {}  # D: each request's parsed kv_transfer_params, from "needs" to "alloc"
    conn.send(("ready", sched.info()))
    while True:
        if conn.poll(0.0002):
            cmd, *args = conn.recv()
            reply: Any = None
            if cmd == "shutdown":
                worker.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "needs":  # kv_transfer_params as JSON, parsed as the server parses them
                sources[args[0]] = decode(args[1])
                reply = sched.needs_remote_kv(args[0], sources[args[0]])
            elif cmd == "alloc":  # (request id, blocks, local tokens, prompt tokens)
                sched.on_blocks_allocated(*args, sources.pop(args[0]))
            elif cmd == "finish":  # -> (keep blocks, the answer's kv_transfer_params as JSON)
                keep = sched.on_request_finished(*args[:3], decode(args[3]))
                answer = sched.take_answer(args[0])
                reply = keep, None if answer is None else encode(answer)
            elif cmd == "results":
                reply = {k: list(v) for k, v in results.items()}
            elif cmd == "block_sums":  # [len(block_ids)] float64 sums over layers, K/V and the block's rows
                reply = kv[args[0]].double().sum(dim=(1, 2, 3, 4, 5)).tolist()
            elif cmd == "stats":
                reply = worker.stats().received_bytes
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
            if any((x[0] if isinstance(x, tuple | list) else x) == rid for x in res["failed_recvs"]):
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


def run(mode: str, a: argparse.Namespace, scattered: bool) -> dict[str, Any]:
    n_blocks = -(-(a.tokens + 1) // a.block_size)  # the prompt is tokens + 1 long: D recomputes the last
    num_blocks = 2 * n_blocks + 8
    ctx = mp.get_context("spawn")
    p = Proc(ctx, a.prefill_gpu, "prefill", mode, a.model, a.block_size, num_blocks)
    d = Proc(ctx, a.decode_gpu, "decode", mode, a.model, a.block_size, num_blocks)
    rng = random.Random(0)
    times, ready, nbytes = [], [], 0
    try:
        p.ready(), d.ready()
        for i in range(a.repeat + 1):  # the first one pays for the handshake and UCX's first-use costs
            if scattered:
                p_blocks, d_blocks = rng.sample(range(num_blocks), n_blocks), rng.sample(range(num_blocks), n_blocks)
            else:
                p_blocks = d_blocks = list(range(i % 2 * 4, i % 2 * 4 + n_blocks))
            rid = f"{mode}-{i}"
            if mode == "pull":
                _, params = p.call("finish", f"p-{rid}", p_blocks, a.tokens + 1, {"do_remote_decode": True})
                d.call("needs", rid, params)
                t0 = time.time()
                d.call("alloc", rid, d_blocks, 0, a.tokens + 1)
            else:
                info = p.info
                d_params = {"do_remote_prefill": True, "transfer_id": rid, "remote_engine_id": info["engine_id"],
                            "remote_host": info["side_channel_host"], "remote_port": info["side_channel_port"],
                            "tp_size": info["tp_size"], "transfer_mode": "push"}  # fmt: skip
                d.call("needs", rid, d_params)
                d.call("alloc", rid, d_blocks, 0, a.tokens + 1)
                deadline = time.monotonic() + 30
                while "registration_sent" not in d.events(rid) and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.02)  # let the registration reach P: the WRITE then starts at P's finish
                t0 = time.time()
                p.call("finish", f"p-{rid}", p_blocks, a.tokens + 1,
                       {"do_remote_decode": True, "transfer_id": rid, "transfer_mode": "push"})  # fmt: skip
            d.wait("finished_recvs", rid)
            p.wait("finished_sends", f"p-{rid}")
            ev_d = d.events(rid)
            posted = ev_d["transfer_posted"] if mode == "pull" else p.events(f"p-{rid}")["transfer_posted"]
            if i > 0:
                times.append(ev_d["kv_received"] - posted)
                ready.append(ev_d["kv_received"] - t0)
            if i in (0, a.repeat):  # D recomputes the last prompt token: --tokens tokens move, whole blocks
                moved = -(-a.tokens // a.block_size)  # the blocks holding the tokens D does not recompute
                ps, ds = p.call("block_sums", p_blocks[:moved]), d.call("block_sums", d_blocks[:moved])
                assert ps == ds, f"{mode}: D's blocks differ from P's"
        nbytes = d.call("stats") // (a.repeat + 1)
    finally:
        d.close()
        p.close()
    med = statistics.median(times)
    out = {"mode": mode, "blocks": "scattered" if scattered else "contiguous", "tokens": a.tokens,
           "bytes": nbytes, "median_ms": round(med * 1e3, 3), "best_ms": round(min(times) * 1e3, 3),
           "GB_per_s": round(nbytes / med / 1e9, 1), "best_GB_per_s": round(nbytes / min(times) / 1e9, 1),
           "ready_ms": round(statistics.median(ready) * 1e3, 3)}  # fmt: skip
    print(f"{mode:5} {out['blocks']:10} {nbytes / 1e9:.3f} GB: median {out['median_ms']:.2f} ms = "
          f"{out['GB_per_s']:.1f} GB/s (best {out['best_GB_per_s']:.1f}); request ready after "
          f"{out['ready_ms']:.2f} ms", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="shape preset whose KV layout is moved")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--layouts", default="contiguous,scattered")
    ap.add_argument("--prefill-gpu", type=int, default=0, help="-1: the CPU (DRAM), for a smoke test")
    ap.add_argument("--decode-gpu", type=int, default=1, help="-1: the CPU (DRAM)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    rows = [run(m, a, lay == "scattered") for lay in a.layouts.split(",") for m in a.modes.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
