"""`pdserve generate MODEL --prompt TEXT`: offline generation with the engine."""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m", help="model name, HF folder or .gguf file")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy = random weights")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        block_size=args.block_size,
        num_threads=args.num_threads,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f"--- {prompt!r}\n{out.text}")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]")
    llm.shutdown()
    return 0
