"""A Gemma-3-shaped model (interleaved sliding-window and global layers) on one GPU: prefill and decode speed
at long inputs, and KV bytes held per request against a full-attention model of the same shape.

    python scripts/bench_swa_gpu.py [--model gemma3-12b] [--input-lens 4096,16384] [--out swa_gpu.json]

Dummy bf16 weights. Windowed layers run the portable attention path on CUDA (no Triton kernel starts at the
window yet), so this measures what that path costs, not a tuned ceiling. KV bytes: blocks the request holds
after its prefill (windowed groups keep only their window's blocks) x bytes per block, against every layer
holding every token. Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-12b")
    ap.add_argument("--input-lens", default="4096,16384")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_memory_gib=24,
              max_num_batched_tokens=4096, max_model_len=32768, enable_prefix_caching=False)  # fmt: skip
    arch = llm.engine.runner.decoder.arch
    rows = []
    for n in (int(x) for x in a.input_lens.split(",")):
        prompt = [[(i * 7919) % 200_000 + 100 for i in range(n)]]
        llm.generate(prompt, SamplingParams.greedy(1))  # warm-up at this length
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams.greedy(1))
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams.greedy(1 + a.decode_tokens, ignore_eos=True))
        torch.cuda.synchronize()
        decode = (time.perf_counter() - t0 - prefill) / a.decode_tokens
        elem = 2  # bf16
        full_bytes = 2 * arch.num_layers * n * arch.num_kv_heads * arch.head_dim * elem
        windows = arch.layer_windows or (None,) * arch.num_layers  # tokens each layer keeps (None: all)
        held = 2 * sum(n if w is None else min(n, w) for w in windows) * arch.num_kv_heads * arch.head_dim
        rows.append({"input": n, "prefill_ms": round(prefill * 1e3, 1), "decode_ms_per_token": round(decode * 1e3, 2),
                     "kv_bytes_full_attention": full_bytes, "kv_bytes_windowed": held * elem,
                     "kv_ratio": round(held * elem / full_bytes, 3)})  # fmt: skip
    llm.shutdown()
    print(f"\n{a.model} (dummy bf16, one GPU, portable attention path for windowed layers)")
    print(
        f"{'input':>6} {'prefill ms':>10} {'decode ms/tok':>13} {'KV full MB':>10} {'KV windowed MB':>14} {'ratio':>6}"
    )
    for r in rows:
        print(f"{r['input']:6d} {r['prefill_ms']:10.1f} {r['decode_ms_per_token']:13.2f} "
              f"{r['kv_bytes_full_attention'] / 1e6:10.0f} {r['kv_bytes_windowed'] / 1e6:14.0f} {r['kv_ratio']:6.3f}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
