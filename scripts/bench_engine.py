"""Engine speed vs transformers on this machine, same model, same prompts, side by side in one run.

Usage: .venv/bin/python scripts/bench_engine.py [--model smollm2-135m] [--input-len 512] [--output-len 64]
Prints a table (TTFT at batch 1, decode tok/s at batch 1, end-to-end tok/s with 8 prompts) and writes JSON.
pdserve runs twice per round: with its CPU decode kernel (model/cpu/attention.py) and with the portable
gather-and-matmul attention (`portable` column), so the kernel's gain is a ratio taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def hf_generate(model, prompts: list[list[int]], max_new: int) -> tuple[float, float]:
    """transformers: manual greedy loop with its KV cache (faster than generate() here). Returns (ttft, total)."""
    t0 = time.perf_counter()
    ttft = 0.0
    with torch.inference_mode():
        for p in prompts:  # transformers has no continuous batching: one sequence after another
            ids = torch.tensor([p])
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if not ttft:
                ttft = time.perf_counter() - t0
            for _ in range(max_new - 1):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return ttft, time.perf_counter() - t0


def hf_generate_batched(model, prompts: list[list[int]], max_new: int) -> float:
    """transformers generate() with a padded batch (equal lengths here, so no padding)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor(prompts), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return time.perf_counter() - t0


def ours(llm, prompts: list[list[int]], max_new: int, kernel: bool = True) -> tuple[float, float]:
    from pdserve import SamplingParams

    llm.engine.runner.decoder.use_cpu_kernel = kernel
    params = SamplingParams.greedy(max_new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
    ttft = min(o.timeline["first_token"] - o.timeline["arrival"] for o in outs)
    return ttft, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians are reported")
    ap.add_argument("--out", default="docs/results/cpu/engine.json")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pdserve import LLM

    llm = LLM(args.model, enable_prefix_caching=False)
    from pdserve.model.builtin import builtin_gguf_path, is_builtin
    from pdserve.model.loader import gguf_to_folder

    # the same weights, as a Hugging Face folder
    folder = gguf_to_folder(builtin_gguf_path(args.model), args.model) if is_builtin(args.model) else args.model
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(100, vocab - 100, (n, args.input_len), generator=g).tolist()

    ours(llm, prompts(1), 4)  # warm-up both
    hf_generate(hf, prompts(1), 4)
    # Interleave the two engines and take medians: absolute times on a shared 2-core machine drift.
    samples: dict[str, list[tuple[float, float, float]]] = {}  # metric -> (pdserve, portable, transformers)
    n = args.output_len
    for _ in range(args.repeats):
        p1 = prompts(1)
        ttft_o, tot_o = ours(llm, p1, n)
        ttft_p, tot_p = ours(llm, p1, n, kernel=False)
        ttft_h, tot_h = hf_generate(hf, p1, n)
        samples.setdefault("ttft_s_batch1", []).append((ttft_o, ttft_p, ttft_h))
        samples.setdefault("decode_tok_s_batch1", []).append(
            ((n - 1) / (tot_o - ttft_o), (n - 1) / (tot_p - ttft_p), (n - 1) / (tot_h - ttft_h))
        )
        pb = prompts(args.batch)
        _, tot_o = ours(llm, pb, n)
        _, tot_p = ours(llm, pb, n, kernel=False)
        tot_h = hf_generate_batched(hf, pb, n)
        samples.setdefault(f"e2e_tok_s_batch{args.batch}", []).append(
            (args.batch * n / tot_o, args.batch * n / tot_p, args.batch * n / tot_h)
        )
    rows = {k: tuple(statistics.median(s[i] for s in v) for i in range(3)) for k, v in samples.items()}
    print(f"{'metric':<24}{'pdserve':>10}{'portable':>10}{'transformers':>14}{'vs portable':>13}{'vs transf.':>12}")
    for k, (o, p, h) in rows.items():
        faster = (lambda a, b: b / a) if k.startswith("ttft") else (lambda a, b: a / b)
        print(f"{k:<24}{o:>10.3f}{p:>10.3f}{h:>14.3f}{faster(o, p):>12.2f}x{faster(o, h):>11.2f}x")
    import os

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": args.model,
                "date": time.strftime("%Y-%m-%d"),
                "input_len": args.input_len,
                "output_len": args.output_len,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "load_average": os.getloadavg(),
                "rows": {k: {"pdserve": o, "pdserve_portable": p, "transformers": h} for k, (o, p, h) in rows.items()},
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
