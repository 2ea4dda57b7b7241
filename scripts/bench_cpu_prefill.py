"""CPU prefill attention: the in-place C kernel (csrc/paged_prefill.c) against torch's fused SDPA, side by side.

Usage: .venv/bin/python scripts/bench_cpu_prefill.py [--model smollm2-135m] [--lens 128 512 2048] [--rounds 5]
       [--threads 2 | --threads 1 --cpu-time]

Two tables, both interleaved per round (kernel, SDPA, kernel, SDPA, ...), medians reported:
  1. one layer's attention at the model's head shape, from a paged cache with shuffled blocks, per prompt length;
  2. the whole engine's TTFT of one prompt (max_tokens 1, no prefix cache), the kernel on and off.
"Off" routes prefill spans to the path attention.py takes without the kernel (SDPA over the span's K/V).
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.model.cpu import attention as cpu_attention
from pdserve.model.cpu import kernels as cpu_kernels


def _median_ms(fn: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def attention_alone(
    heads: int, kv_heads: int, head_dim: int, length: int, rounds: int, clock: Callable[[], float]
) -> dict[str, float]:
    """One layer's causal attention over `length` tokens: kernel vs SDPA (GQA, no K/V copy), ms by `clock`."""
    lib = cpu_kernels.library()
    assert lib is not None, "the CPU kernel library did not build"
    bs = 16
    nb = -(-length // bs)
    gen = torch.Generator().manual_seed(length)
    k_cache = torch.randn(nb + 8, bs, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(nb + 8, bs, kv_heads, head_dim, generator=gen)
    table = torch.randperm(nb + 8, generator=gen)[:nb]
    # q as the layer hands it over: a view of the qkv projection's output (the kernel reads it in place)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(length, heads, head_dim)
    k = k_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    v = v_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    scale = head_dim**-0.5

    def ours() -> object:
        return cpu_attention.paged_prefill(lib, q, k_cache, v_cache, table, length, scale, None)

    def sdpa() -> object:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=heads > kv_heads)

    err = (ours() - sdpa()[0].transpose(0, 1)).abs().max().item()
    reps = max(3, 2048 // length)
    res: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    for _ in range(rounds):
        res["kernel"].append(_median_ms(ours, reps, clock))
        res["sdpa"].append(_median_ms(sdpa, reps, clock))
    out = {name: statistics.median(v) for name, v in res.items()}
    return {**out, "sdpa_over_kernel": out["sdpa"] / out["kernel"], "max_abs_diff": err}


def engine_ttft(llm, length: int, rounds: int) -> dict[str, float]:
    """TTFT of one `length`-token prompt in-process, the kernel on and off, ms."""
    from pdserve import SamplingParams

    gen = torch.Generator().manual_seed(1)
    params = SamplingParams.greedy(1, ignore_eos=True)

    def one(kernel: bool) -> float:
        llm.engine.runner.decoder.use_cpu_prefill_kernel = kernel
        prompt = torch.randint(0, llm.engine.vocab_size, (length,), generator=gen).tolist()
        out = llm.generate([prompt], params)[0]
        return (out.timeline["first_token"] - out.timeline["arrival"]) * 1e3

    one(True), one(False)  # warm-up
    res: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    for _ in range(rounds):
        res["kernel"].append(statistics.median(one(True) for _ in range(3)))
        res["sdpa"].append(statistics.median(one(False) for _ in range(3)))
    llm.engine.runner.decoder.use_cpu_prefill_kernel = True
    out = {name: statistics.median(v) for name, v in res.items()}
    return {**out, "sdpa_over_kernel": out["sdpa"] / out["kernel"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model whose head shape and engine are measured")
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 2048], help="prompt lengths, tokens")
    ap.add_argument("--ttft-len", type=int, default=512, help="prompt length of the engine TTFT table")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the attention table by the process's CPU time (one thread only): on a shared machine a"
        " preempted call's wall time counts the other work, its CPU time does not",
    )
    ap.add_argument("--out", default="docs/results/cpu/prefill_kernel.json", help="JSON written here")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1 (with more, spinning OpenMP threads count too)")
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    from pdserve import LLM

    llm = LLM(args.model, enable_prefix_caching=False)
    arch = llm.engine.runner.decoder.arch
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    rows = []
    timed = "CPU time" if args.cpu_time else "wall time"
    print(f"one layer's attention, {heads} heads / {kv_heads} KV heads x {head_dim}, {args.threads} threads, {timed}")
    print(f"{'tokens':>7} {'kernel ms':>10} {'SDPA ms':>9} {'SDPA/kernel':>12} {'max |diff|':>11}")
    for length in args.lens:
        r = attention_alone(heads, kv_heads, head_dim, length, args.rounds, clock)
        rows.append({"tokens": length, **r})
        print(
            f"{length:>7} {r['kernel']:>10.2f} {r['sdpa']:>9.2f} {r['sdpa_over_kernel']:>12.2f}"
            f" {r['max_abs_diff']:>11.1e}"
        )
    ttft = engine_ttft(llm, args.ttft_len, args.rounds)
    print(
        f"\nengine TTFT, {args.ttft_len}-token prompt: kernel {ttft['kernel']:.1f} ms, SDPA {ttft['sdpa']:.1f} ms,"
        f" SDPA/kernel {ttft['sdpa_over_kernel']:.3f}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"model": args.model, "threads": args.threads, "timed": timed, "attention": rows, "ttft": ttft}, indent=1
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
