"""Tensor parallelism on GPUs: TP 1 vs TP N on the same random-weight shape, greedy tokens and speed, one run.

    python scripts/bench_tp_gpu.py [--model qwen3-8b] [--tp 2] [--out tp.json]

Three engines in turn: TP 1, TP N with CUDA graphs, TP N eager (--enforce-eager). Each loads the dummy model
(TP N spawns N - 1 rank processes, NCCL), generates greedy tokens for a few prompts (compared with TP 1: bf16
near-ties may flip a token late; float32 is a strict check), then times decode at batch 1, 8 and 32 (ms per
token: (generate(1 + n) - generate(1)) / n) and one 8k-token prefill. Prints a table, writes JSON; asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from pdserve import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], n: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams.greedy(n, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(model: str, tp: int, prompts: list[list[int]], dtype: str, eager: bool) -> dict:
    llm = LLM(model, load_format="dummy", dtype=dtype, device="cuda", tensor_parallel_size=tp,
              kv_cache_memory_gib=8, max_num_batched_tokens=8192, enable_prefix_caching=False,
              enforce_eager=eager)  # fmt: skip
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(32, ignore_eos=True))]
        graphs = llm.engine.runner.graphs
        out: dict = {"tp": tp, "cuda_graphs": graphs is not None, "tokens": tokens, "decode_ms_per_token": {}}
        for batch in (1, 8, 32):
            ps = (prompts * 8)[:batch]
            n = 64
            base = statistics.median(timed(llm, ps, 1) for _ in range(3))
            full = statistics.median(timed(llm, ps, 1 + n) for _ in range(3))
            out["decode_ms_per_token"][str(batch)] = round((full - base) / n * 1e3, 3)
        long = [[(i * 7919) % 30000 + 100 for i in range(8192)]]
        out["prefill_ms_8192"] = round(statistics.median(timed(llm, long, 1) for _ in range(3)) * 1e3, 2)
        out["graph_replays"] = graphs.replays if graphs is not None else 0
        return out
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", help="float32 makes TP 2 == TP 1 a strict check")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prompts = [[(p * 131 + i * 17) % 30000 + 100 for i in range(64 + 32 * p)] for p in range(4)]
    rows = [measure(a.model, 1, prompts, a.dtype, False)]
    rows += [measure(a.model, a.tp, prompts, a.dtype, False), measure(a.model, a.tp, prompts, a.dtype, True)]
    for r in rows[1:]:
        r["same_tokens_as_tp1"] = [x == y for x, y in zip(rows[0]["tokens"], r["tokens"], strict=True)]
        r["first_diff"] = [
            next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), None)
            for x, y in zip(rows[0]["tokens"], r["tokens"], strict=True)
        ]
    print(f"\n{a.model}, {a.dtype}, dummy weights; greedy 32 tokens x 4 prompts")
    print(f"{'tp':>3} {'graphs':>6} {'b=1 ms':>8} {'b=8 ms':>8} {'b=32 ms':>8} {'prefill 8k':>11}  same as TP 1")
    for r in rows:
        d = r["decode_ms_per_token"]
        print(f"{r['tp']:3d} {str(r['cuda_graphs']):>6} {d['1']:8.2f} {d['8']:8.2f} {d['32']:8.2f} "
              f"{r['prefill_ms_8192']:11.1f}  {r.get('same_tokens_as_tp1', '')} {r.get('first_diff', '')}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "dtype": a.dtype, "date": time.strftime("%Y-%m-%d"),
                       "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
