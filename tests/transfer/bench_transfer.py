"""Benchmark (not a test): pull and push of one request's KV between two processes on this machine.

    .venv/bin/python tests/transfer/bench_transfer.py [--tokens 512] [--block-size 16] [--repeat 20] [--contiguous]
    .venv/bin/python tests/transfer/bench_transfer.py --cpu   # what the transfer thread costs, idle and hot

Shape: SmolLM2-135M (30 layers, 3 KV heads, head dim 64, float32): 46 KB per token, 23.6 MB for 512 tokens.
Blocks are scattered (a random permutation) on both sides, so every block is its own descriptor (the cache is
block-major: 32 descriptors for 512 tokens); --contiguous puts them in one run (merged: 1 descriptor).
Times come from the instances' own timeline events (time.time(), same host):
  pull: D "transfer_posted" -> D "kv_received" (the READ; the handshake is cached after the first request)
  push: P "transfer_posted" -> D "kv_received" (WRITE + completion notification + D noticing it)
and "ready": from the driver handing the last piece (pull: D's allocation; push: P's finished prefill,
D registered long before) to D's "kv_received" — what the request waits for in each mode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[2]))  # the repository, when pdserve is not installed
from harness import Instance, close_all, events, push_params, start_all  # noqa: E402

DIMS = (30, 3, 64)


def run(mode: str, tokens: int, block_size: int, repeat: int, contiguous: bool) -> None:
    n_blocks = -(-tokens // block_size)
    num_blocks = 2 * n_blocks + 8
    insts = start_all(
        p=Instance("prefill", mode, block_size=block_size, num_blocks=num_blocks, dims=DIMS),
        d=Instance("decode", mode, block_size=block_size, num_blocks=num_blocks, dims=DIMS),
    )
    p, d = insts["p"], insts["d"]
    rng = random.Random(0)
    xfer, ready, nbytes = [], [], 0
    try:
        for i in range(repeat + 1):  # the first one pays for the handshake
            p_blocks = list(range(n_blocks)) if contiguous else rng.sample(range(num_blocks), n_blocks)
            d_blocks = list(range(n_blocks)) if contiguous else rng.sample(range(num_blocks), n_blocks)
            rid = f"{mode}-{i}"
            if mode == "pull":
                _, params = p.call("finish", f"p-{rid}", p_blocks, tokens + 1, {"do_remote_decode": True})
                d.call("needs", rid, params)
                t0 = time.time()
                d.call("alloc", rid, d_blocks, 0, tokens + 1)
            else:
                p_params, d_params = push_params(p, rid)
                d.call("needs", rid, d_params)
                d.call("alloc", rid, d_blocks, 0, tokens + 1)
                while "registration_sent" not in events(d, rid):
                    time.sleep(0.002)
                time.sleep(0.02)  # let the registration reach P
                t0 = time.time()
                p.call("finish", f"p-{rid}", p_blocks, tokens + 1, p_params)
            assert d.wait_result(rid) == ("finished", None)
            p.wait_send(f"p-{rid}")
            ev_d = events(d, rid)
            posted = ev_d["transfer_posted"] if mode == "pull" else events(p, f"p-{rid}")["transfer_posted"]
            if i > 0:
                xfer.append(ev_d["kv_received"] - posted)
                ready.append(ev_d["kv_received"] - t0)
        nbytes = d.call("stats")["received_bytes"] // (repeat + 1)
    finally:
        close_all(insts)
    med = statistics.median(xfer)
    where = "contiguous" if contiguous else "scattered"
    print(f"{mode}: {tokens} tokens, block {block_size} {where}, {nbytes / 1e6:.1f} MB, {repeat} runs: transfer median "
          f"{med * 1e3:.2f} ms = {nbytes / med / 1e9:.2f} GB/s (best {nbytes / min(xfer) / 1e9:.2f}); "
          f"ready after {statistics.median(ready) * 1e3:.2f} ms median")  # fmt: skip


def cpu_cost(seconds: float = 5.0) -> None:
    """CPU of one worker's threads in this process: idle (1 ms waits) and hot (a pinned pull send: 50 us polls)."""
    import torch

    from pdserve.config import TransferConfig
    from pdserve.kv.geometry import CacheGeometry
    from pdserve.kv.params import RemoteDecode
    from pdserve.transfer.base import KVCacheSpec
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--contiguous", action="store_true", help="both sides' blocks in one run (merged descriptors)")
    ap.add_argument("--cpu", action="store_true", help="measure the transfer thread's CPU cost instead")
    a = ap.parse_args()
    if a.cpu:
        cpu_cost()
        sys.exit()
    for m in a.modes.split(","):
        run(m, a.tokens, a.block_size, a.repeat, a.contiguous)
