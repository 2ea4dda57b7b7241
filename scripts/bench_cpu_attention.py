"""Decode attention on the CPU: the in-place C kernel vs the portable gather-and-matmul path, side by side.

    .venv/bin/python scripts/bench_cpu_attention.py [--threads 2] [--context 512] [--batches 1,8] [--rounds 5]

SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, 30 layers of a block-major cache, 16-token
blocks, float32), every sequence's blocks shuffled through the pool. One "step" is one decode attention call
per layer (30 calls), as the engine makes; the two paths alternate round by round and the medians are printed.
With --engine, whole decode steps of the engine (pdserve.LLM, built-in model) instead: `batch` requests with
`context`-token prompts are prefilled, then engine.step() runs with the kernel and without it on alternate steps
(bursts of other load on a shared machine then hit both alike); medians of the step times are printed.
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


def engine_steps(bsz: int, context: int, steps: int, threads: int) -> None:
    """Median engine decode-step time with and without the CPU kernel, alternating step by step."""
    from pdserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", enable_prefix_caching=False, num_threads=threads)
    eng, dec = llm.engine, llm.engine.runner.decoder
    gen = torch.Generator().manual_seed(bsz)
    for i in range(bsz):
        prompt = torch.randint(100, 40000, (context,), generator=gen).tolist()
        eng.add_request(f"r{i}", prompt, SamplingParams.greedy(steps + 2, ignore_eos=True))
    while eng.scheduler.waiting or any(not r.output_token_ids for r in eng.scheduler.running):
        eng.step()  # prefill everything first
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps):
        dec.use_cpu_kernel = i % 2 == 0
        t = time.perf_counter()
        eng.step()
        times[dec.use_cpu_kernel].append((time.perf_counter() - t) * 1e3)
    old, new = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"engine, batch {bsz}, {context}-token prompts, {threads} threads: decode step portable {old:.1f} ms, "
        f"kernel {new:.1f} ms, {old / new:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per round")
    ap.add_argument("--engine", action="store_true", help="whole engine decode steps (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        for bsz in (int(b) for b in args.batches.split(",")):
            engine_steps(bsz, args.context, 2 * args.rounds * args.steps, args.threads)
        return
    layers, bs, h, hkv, d = 30, 16, 9, 3, 64
    for bsz in (int(b) for b in args.batches.split(",")):
        nb = -(-args.context // bs)
        num_blocks = bsz * nb + 8
        kv = torch.randn(num_blocks, layers, 2, hkv, bs, d)  # the engine's layout (heads before tokens)
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
