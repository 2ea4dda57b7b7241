"""pdserve vs transformers on one CUDA GPU: same random-weight model shape (bf16), same prompts, one run.

    python scripts/bench_gpu_engine.py [--model qwen3-8b] [--out docs/results/h200/engine.json]
                                       [--detail PATH] [--decode-context 2048] [--skip-hf]

Measures (medians of repeated runs, after warm-up):
  TTFT at 1k and 8k input, batch 1: pdserve `LLM.generate(max_tokens=1)` wall time (one 8192-token step);
    transformers `generate(max_new_tokens=1)` (SDPA attention).
  Decode ms per token at batch 1, 8, 32 with a ~2k-token context per sequence: pdserve = median wall time
    of an engine step while every sequence decodes (scheduler + CUDA graph replay + sampling);
    transformers = (generate(N+1) - generate(1)) / N, EOS suppressed.
Writes the summary JSON (--out) with exactly the keys engine.json carries, and a detail JSON (component
times: graph replay alone, GEMV bandwidth, attention kernel, prefill TFLOP/s; the portable path for contrast).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams

TTFT_LENS = (1024, 8192)
BATCHES = (1, 8, 32)


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _flops_per_token(arch) -> float:
    """Matmul FLOPs per prompt token (no attention, no lm_head): 2 x non-embedding parameters."""
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return 2.0 * layers * (h * (q + 2 * kv) + q * h + 3 * h * i)


def _attention_flops(arch, n: int) -> float:
    """Causal attention FLOPs of an n-token prompt (QK^T and PV, half the square)."""
    return 4.0 * arch.num_layers * arch.num_heads * arch.head_dim * n * n / 2


# ---- pdserve ------------------------------------------------------------------------------------------------
def bench_pdserve(
    model: str,
    decode_ctx: int,
    decode_steps: int,
    detail: dict,
    ttft_lens: tuple[int, ...] = TTFT_LENS,
    prefill_only: bool = False,
) -> tuple[dict, dict]:
    budget = max(8192, *ttft_lens)  # one step per prompt
    llm = LLM(
        model,
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        kv_cache_memory_gib=24.0,
        max_model_len=max(16384, budget + 16),
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    arch = eng.runner.decoder.arch
    if eng.runner.graphs is not None:  # one-row step, ms: 0 = cuBLAS, 1 = Triton GEMV (the faster is used)
        detail["gemv_calibration_ms"] = {str(k): round(v, 3) for k, v in eng.runner.graphs.gemv_calibration.items()}
        print("one-row step (graph replay, ms), cuBLAS vs Triton GEMV:", detail["gemv_calibration_ms"], flush=True)
    vocab = arch.vocab_size
    greedy1 = SamplingParams.greedy(1, ignore_eos=True)
    prefill: dict[str, float] = {}
    for n in ttft_lens:
        times = []
        for rep in range(4):  # the first is warm-up
            prompt = _prompts(1, n, seed=1000 * n + rep, vocab=vocab)[0]
            t0 = _sync_time()
            llm.generate([prompt], greedy1)
            times.append(time.perf_counter() - t0)
        prefill[str(n)] = 1e3 * statistics.median(times[1:])
        tf = (_flops_per_token(arch) * n + _attention_flops(arch, n)) / (prefill[str(n)] / 1e3) / 1e12
        detail.setdefault("prefill_tflops", {})[str(n)] = round(tf, 1)
        print(f"pdserve TTFT {n}: {prefill[str(n)]:.1f} ms ({tf:.0f} TFLOP/s)", flush=True)
    if prefill_only:
        llm.shutdown()
        return prefill, {}

    decode: dict[str, float] = {}
    for b in BATCHES:
        decode[str(b)], step_ms = _pdserve_decode(llm, b, decode_ctx, decode_steps, vocab)
        graph = eng.runner.graphs
        if graph is not None:
            detail.setdefault("graph_replay_ms", {})[str(b)] = round(_replay_ms(graph, b), 3)
        print(
            f"pdserve decode b={b}: {decode[str(b)]:.2f} ms/token (graph replay alone "
            f"{detail.get('graph_replay_ms', {}).get(str(b), float('nan'))} ms)",
            flush=True,
        )
    _component_times(eng, decode_ctx, detail)

    # the same steps without graphs, then without the fused kernels (portable path), batch 1 only
    worker, graphs = eng.runner, eng.runner.graphs
    worker.graphs = None
    detail["eager_fused_decode_ms_b1"] = round(_pdserve_decode(llm, 1, decode_ctx, 16, vocab)[0], 2)
    worker.decoder.use_fused_kernels = False
    detail["portable_decode_ms_b1"] = round(_pdserve_decode(llm, 1, decode_ctx, 8, vocab)[0], 2)
    prompt = _prompts(1, 8192, seed=77, vocab=vocab)[0]
    t0 = _sync_time()
    llm.generate([prompt], greedy1)
    detail["portable_prefill_ms_8192"] = round(1e3 * (time.perf_counter() - t0), 1)
    worker.decoder.use_fused_kernels, worker.graphs = True, graphs
    print(
        f"eager fused b=1: {detail['eager_fused_decode_ms_b1']} ms; portable b=1: "
        f"{detail['portable_decode_ms_b1']} ms; portable 8k prefill {detail['portable_prefill_ms_8192']} ms"
    )
    llm.shutdown()
    del llm, eng, worker, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return prefill, decode


def _pdserve_decode(llm: LLM, batch: int, ctx: int, steps: int, vocab: int) -> tuple[float, list[float]]:
    """Median wall time of an engine step while all `batch` sequences decode (context ~ctx tokens)."""
    eng = llm.engine
    params = SamplingParams.greedy(steps + 2, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, ctx - steps, seed=batch, vocab=vocab)):
        eng.add_request(f"dec-{batch}-{i}-{time.monotonic_ns()}", p, params)
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    times = []
    while eng.has_work():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    full = [t for t in times[:-1]]  # the last step finishes every request (extra bookkeeping)
    return 1e3 * statistics.median(full[1:]), full


def _replay_ms(graphs, batch: int) -> float:
    """GPU time of one captured decode step (graph replay alone, no Python around it)."""
    rows = next(b for b in graphs.buckets if b >= batch)
    graph, _ = graphs._graphs[rows]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def _component_times(eng, ctx: int, detail: dict) -> None:
    """Batch-1 pieces: each weight's GEMV (achieved GB/s), the decode attention kernel at ctx tokens."""
    from triton.testing import do_bench

    from pdserve.model.cuda.attention import decode_attention
    from pdserve.model.paged import DecodeBatch, cache_block_size, layer_view

    dec = eng.runner.decoder
    layer = dec.layers[0]
    x = torch.randn(1, dec.arch.hidden_size, device="cuda", dtype=torch.bfloat16)
    gemv = {}
    for name, lin, inp in [
        ("qkv", layer.qkv_proj, x),
        ("o", layer.o_proj, x),
        ("gate_up", layer.gate_up_proj, x),
        ("down", layer.down_proj, torch.randn(1, dec.arch.intermediate_size, device="cuda", dtype=torch.bfloat16)),
    ]:
        ms = do_bench(lambda lin=lin, inp=inp: lin(inp), warmup=25, rep=100, return_mode="median")
        gbs = lin.weight.numel() * 2 / (ms / 1e3) / 1e9
        gemv[name] = {"us": round(ms * 1e3, 1), "GB/s": round(gbs)}
    head = dec.embed_tokens.weight if dec.lm_head is None else dec.lm_head.weight
    ms = do_bench(lambda: dec.logits(x), warmup=25, rep=100, return_mode="median")
    gemv["lm_head"] = {"us": round(ms * 1e3, 1), "GB/s": round(head.numel() * 2 / (ms / 1e3) / 1e9)}
    detail["gemv_b1"] = gemv
    kv = eng.runner.kv_cache
    bs = cache_block_size(kv)
    nblk = -(-ctx // bs)
    q = torch.randn(1, dec.arch.num_heads, dec.arch.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    d = DecodeBatch(
        torch.zeros(1, dtype=torch.long, device="cuda"),
        torch.randperm(kv.shape[0], device="cuda")[:nblk].unsqueeze(0),
        torch.tensor([ctx], device="cuda"),
        ctx,
    )
    layer0 = layer_view(kv, 0)  # [2, num_blocks, block_size, heads, head_dim], block-major HND strides
    ms = do_bench(lambda: decode_attention(q, layer0, d, 0.1, out), warmup=25, rep=100, return_mode="median")
    kv_bytes = 2 * ctx * dec.arch.num_kv_heads * dec.arch.head_dim * 2
    detail["decode_attention_b1"] = {"ctx": ctx, "us": round(ms * 1e3, 1), "GB/s": round(kv_bytes / (ms / 1e3) / 1e9)}
    print("GEMV b=1:", gemv, "| attention:", detail["decode_attention_b1"], flush=True)


# ---- transformers ---------------------------------------------------------------------------------------------
def bench_hf(model: str, decode_ctx: int, steps: int) -> tuple[dict, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.model.presets import get_preset

    preset = get_preset(model)
    cfg = AutoConfig.for_model(preset["model_type"], **{k: v for k, v in preset.items() if k != "model_type"})
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    vocab = preset["vocab_size"]

    def gen(ids: torch.Tensor, n: int, hf=hf) -> float:
        t0 = _sync_time()
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0

    prefill = {}
    for n in TTFT_LENS:
        times = [gen(torch.tensor(_prompts(1, n, seed=1000 * n + r, vocab=vocab), device="cuda"), 1) for r in range(4)]
        prefill[str(n)] = 1e3 * statistics.median(times[1:])
        print(f"transformers TTFT {n}: {prefill[str(n)]:.1f} ms", flush=True)
    decode = {}
    for b in BATCHES:
        ids = torch.tensor(_prompts(b, decode_ctx - steps, seed=b, vocab=vocab), device="cuda")
        gen(ids, 2)  # warm-up
        t1 = statistics.median([gen(ids, 1) for _ in range(2)])
        tn = gen(ids, steps + 1)
        decode[str(b)] = 1e3 * (tn - t1) / steps
        print(f"transformers decode b={b}: {decode[str(b)]:.2f} ms/token", flush=True)
    del hf, gen
    gc.collect()
    torch.cuda.empty_cache()
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--out", type=Path, default=Path("docs/results/h200/engine.json"))
    ap.add_argument("--detail", type=Path, default=None, help="detail JSON (default: beside --out)")
    ap.add_argument("--decode-context", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--hf-decode-steps", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help="only pdserve's TTFT at --ttft-lens, to --out")
    ap.add_argument("--ttft-lens", default="1024,8192", help="comma-separated prompt lengths (--prefill-only)")
    args = ap.parse_args()
    detail: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.prefill_only:
        lens = tuple(int(x) for x in args.ttft_lens.split(","))
        prefill, _ = bench_pdserve(args.model, args.decode_context, 0, detail, lens, prefill_only=True)
        out = {
            "model": args.model,
            "date": datetime.date.today().isoformat(),
            "device": detail["device"],
            "prefill_ms": {k: round(v, 2) for k, v in prefill.items()},
            "prefill_tflops": detail["prefill_tflops"],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        return
    prefill, decode = bench_pdserve(args.model, args.decode_context, args.decode_steps, detail)
    hf_prefill, hf_decode = (
        ({}, {}) if args.skip_hf else bench_hf(args.model, args.decode_context, args.hf_decode_steps)
    )
    r = lambda d: {k: round(v, 2) for k, v in d.items()}  # noqa: E731
    result = {
        "model": args.model,
        "date": datetime.date.today().isoformat(),
        "decode_ms_per_token": r(decode),
        "hf_decode_ms_per_token": r(hf_decode),
        "prefill_ms": r(prefill),
        "hf_prefill_ms": r(hf_prefill),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    detail_path = args.detail or args.out.with_name(args.out.stem + "_detail.json")
    detail_path.write_text(json.dumps({**result, **detail, "decode_context": args.decode_context}, indent=2) + "\n")
    print(f"\n{'what':<24}{'pdserve':>10}{'transformers':>14}")
    for n in TTFT_LENS:
        print(f"{'TTFT ms @' + str(n):<24}{prefill[str(n)]:>10.1f}{hf_prefill.get(str(n), float('nan')):>14.1f}")
    for b in BATCHES:
        print(f"{'decode ms/tok b=' + str(b):<24}{decode[str(b)]:>10.2f}{hf_decode.get(str(b), float('nan')):>14.2f}")


if __name__ == "__main__":
    main()
