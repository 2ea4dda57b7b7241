"""A Gemma-3-shaped model (interleaved sliding-window and global layers) on one GPU: prefill and decode speed
at long inputs, and KV bytes held per request against a full-attention model of the same shape.

    python scripts/bench_swa_gpu.py [--model gemma3-12b] [--input-lens 4096,16384] [--batch 1] [--eager]
                                    [--out swa_gpu.json]

Dummy bf16 weights. Windowed layers run the CUDA path (model/cuda/attention.py: the Triton decode kernel reads
only the window's pages; tiled band prefill) and decode steps replay CUDA graphs (one context per KV group).
decode_ms_per_token is one step's time (for --batch sequences together), graphs on; with --eager the same
with graphs off (runner.graphs = None), so the two show what the graphs save. KV bytes: every layer holding
every token, against windowed groups holding only their window. Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from pdserve import LLM, SamplingParams


def _decode_ms(llm: LLM, prompts: list[list[int]], prefill_s: float, tokens: int) -> float:
    """ms per decode step: a generation of 1 + tokens minus the prompt-only generation's time."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams.greedy(1 + tokens, ignore_eos=True))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0 - prefill_s) / tokens * 1e3


def _row(llm: LLM, n: int, batch: int, tokens: int, eager: bool) -> dict[str, Any]:
    arch = llm.engine.runner.decoder.arch
    prompts = [[(i * 7919 + j * 104729) % 200_000 + 100 for i in range(n)] for j in range(batch)]
    llm.generate(prompts, SamplingParams.greedy(2))  # warm-up at this length (prefill and a graph replay)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams.greedy(1))
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    row: dict[str, Any] = {"input": n, "batch": batch, "prefill_ms": round(prefill * 1e3, 1)}
    row["decode_ms_per_token"] = round(_decode_ms(llm, prompts, prefill, tokens), 2)
    if eager:
        graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
        row["decode_ms_per_token_eager"] = round(_decode_ms(llm, prompts, prefill, tokens), 2)
        llm.engine.runner.graphs = graphs
    elem = 2  # bf16
    full = 2 * arch.num_layers * n * arch.num_kv_heads * arch.head_dim * elem
    windows = arch.layer_windows or (None,) * arch.num_layers  # tokens each layer keeps (None: all)
    held = 2 * sum(n if w is None else min(n, w) for w in windows) * arch.num_kv_heads * arch.head_dim * elem
    row.update(kv_bytes_full_attention=full, kv_bytes_windowed=held, kv_ratio=round(held / full, 3))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-12b")
    ap.add_argument("--input-lens", default="4096,16384")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (a graph bucket)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="also time decode with CUDA graphs off")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_memory_gib=24,
              max_num_batched_tokens=4096, max_model_len=32768, enable_prefix_caching=False)  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.graphs is not None
    rows = [_row(llm, int(x), a.batch, a.decode_tokens, a.eager) for x in a.input_lens.split(",")]
    llm.shutdown()
    groups = runner.decoder.kv_groups.num_groups
    print(f"\n{a.model} (dummy bf16, one GPU, {groups} KV groups, CUDA graphs {'on' if graphs else 'OFF'})")
    print(f"{'input':>6} {'batch':>5} {'prefill ms':>10} {'decode ms/step':>14} {'eager ms/step':>13} "
          f"{'KV full MB':>10} {'KV windowed MB':>14} {'ratio':>6}")  # fmt: skip
    for r in rows:
        eager = f"{r['decode_ms_per_token_eager']:13.2f}" if "decode_ms_per_token_eager" in r else f"{'-':>13}"
        kv = f"{r['kv_bytes_full_attention'] / 1e6:10.0f} {r['kv_bytes_windowed'] / 1e6:14.0f} {r['kv_ratio']:6.3f}"
        print(f"{r['input']:6d} {r['batch']:5d} {r['prefill_ms']:10.1f} {r['decode_ms_per_token']:14.2f} {eager} {kv}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"model": a.model, "date": time.strftime("%Y-%m-%d"), "graphs": graphs, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
