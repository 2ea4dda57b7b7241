"""Decode attention on the CPU: the in-place C kernel vs the portable gather-and-matmul path, side by side.

    .venv/bin/python scripts/bench_cpu_attention.py [--threads 2] [--context 512] [--batches 1,8] [--rounds 5]

SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, 30 layers of a block-major cache, 16-token
blocks, float32), every sequence's blocks shuffled through the pool. One "step" is one decode attention call
per layer (30 calls), as the engine makes; the two paths alternate round by round and the medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.model.attention import paged_attention
from pdserve.model.paged import AttentionContext, DecodeBatch, layer_view


def step(q: torch.Tensor, views: list[torch.Tensor], ctx: AttentionContext, steps: int, kernel: bool) -> float:
    """Milliseconds per step: one decode attention call per layer view."""
    t = time.perf_counter()
    for _ in range(steps):
        for v in views:
            paged_attention(q, v, ctx, 0.125, None, None, None, cpu_kernel=kernel)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers, bs, h, hkv, d = 30, 16, 9, 3, 64
    for bsz in (int(b) for b in args.batches.split(",")):
        nb = -(-args.context // bs)
        num_blocks = bsz * nb + 8
        kv = torch.randn(num_blocks, layers, 2, bs, hkv, d)
        tables = torch.randperm(num_blocks)[: bsz * nb].view(bsz, nb)
        lens = torch.full((bsz,), args.context)
        dec = DecodeBatch(torch.arange(bsz), tables, lens, args.context, is_uniform=True, rows_are_all=True)
        ctx = AttentionContext(torch.zeros(bsz, dtype=torch.long), [], dec, bs)
        q = torch.randn(bsz, h, d)
        views = [layer_view(kv, i) for i in range(layers)]

        times: dict[bool, list[float]] = {True: [], False: []}
        step(q, views, ctx, args.steps, True), step(q, views, ctx, args.steps, False)  # warm up, build the kernel
        for _ in range(args.rounds):
            for kernel in (False, True):
                times[kernel].append(step(q, views, ctx, args.steps, kernel))
        old, new = statistics.median(times[False]), statistics.median(times[True])
        same = torch.allclose(
            paged_attention(q, views[0], ctx, 0.125, cpu_kernel=True),
            paged_attention(q, views[0], ctx, 0.125, cpu_kernel=False),
            atol=1e-5,
        )
        print(
            f"batch {bsz}, {args.context}-token contexts, 30 layers: portable {old:.2f} ms/step, "
            f"kernel {new:.2f} ms/step, {old / new:.1f}x (equal: {same})"
        )


if __name__ == "__main__":
    main()
