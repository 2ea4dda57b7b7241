"""Where pdserve's CPU engine spends a step: batch-1 decode (512-token context) and a 512-token prefill.

    .venv/bin/python scripts/profile_cpu_engine.py [--threads 2] [--steps 48]

Runs the engine in-process (pdserve.LLM, no HTTP), times engine.step() vs worker.execute() vs the decoder's
forward vs logits+sampling, then prints torch.profiler's top operators for the decode steps and the prefill.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    from pdserve import SamplingParams
    from pdserve.engine.llm import LLM

    llm = LLM("smollm2-135m", num_threads=args.threads)
    eng = llm.engine
    worker, decoder = eng.runner, eng.runner.decoder
    print("torch threads:", torch.get_num_threads(), "| torch", torch.__version__)

    timers: dict[str, list[float]] = {"forward": [], "logits": [], "execute": []}

    def timed(name, fn):
        def wrap(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            timers[name].append(time.perf_counter() - t)
            return r

        return wrap

    decoder.forward = timed("forward", decoder.forward)
    decoder.logits = timed("logits", decoder.logits)
    worker.execute = timed("execute", worker.execute)

    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, 49152) for _ in range(n)]  # noqa: E731
    params = SamplingParams.greedy(args.steps + 8, ignore_eos=True)
    llm.generate([prompt(512)], SamplingParams.greedy(4, ignore_eos=True))  # warmup

    # batch-1 decode: one request, prefill it, then time steps
    for v in timers.values():
        v.clear()
    eng.add_request("p1", prompt(512), params)
    t = time.perf_counter()
    eng.step()  # the prefill
    prefill_s = time.perf_counter() - t
    prefill_fwd = timers["forward"][-1]
    for v in timers.values():
        v.clear()
    steps = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_dec:
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
    while eng.has_work():
        eng.step()
    # timings without the profiler's overhead
    eng.add_request("p2", prompt(512), params)
    eng.step()
    for v in timers.values():
        v.clear()
    steps_np = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        steps_np.append(time.perf_counter() - t)
    while eng.has_work():
        eng.step()
    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"\n== batch-1 decode, ctx ~512 (no profiler), {args.steps} steps")
    print(f"engine.step   {med(steps_np):7.2f} ms  -> {1000 / med(steps_np):.1f} tok/s")
    print(f"worker.execute{med(timers['execute']):7.2f} ms")
    print(f"decoder fwd   {med(timers['forward']):7.2f} ms")
    print(f"logits (lm_head 49152x576) {med(timers['logits']):7.2f} ms")
    print(f"outside execute (scheduler, postprocess): {med(steps_np) - med(timers['execute']):.2f} ms")
    print(f"prefill 512 tokens: step {prefill_s * 1000:.1f} ms, forward {prefill_fwd * 1000:.1f} ms")

    # batch-8 decode: 8 requests prefilled, then time steps where all 8 decode
    for i in range(8):
        eng.add_request(f"b{i}", prompt(512), SamplingParams.greedy(24, ignore_eos=True))
    for _ in range(4):  # prefills (2048-token budget per step) + first decode
        eng.step()
    for v in timers.values():
        v.clear()
    steps8 = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_b8:
        for _ in range(12):
            t = time.perf_counter()
            eng.step()
            steps8.append(time.perf_counter() - t)
    while eng.has_work():
        eng.step()
    print(
        f"\n== batch-8 decode (profiled), 12 steps: step {med(steps8):.2f} ms -> {8000 / med(steps8):.1f} tok/s; "
        f"forward {med(timers['forward']):.2f} ms, logits {med(timers['logits']):.2f} ms"
    )
    print(prof_b8.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))

    print(f"\n== torch.profiler, {args.steps} decode steps (self CPU time)")
    print(prof_dec.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))

    eng.add_request("p3", prompt(512), SamplingParams.greedy(1, ignore_eos=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_pre:
        while eng.has_work():
            eng.step()
    print("\n== torch.profiler, one 512-token prefill (self CPU time)")
    print(prof_pre.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))

    # the bare ops: one decode-size linear vs the same FLOPs as a single matmul, and lm_head alone
    x = torch.randn(1, 576)
    w = decoder.layers[0].gate_up_proj.weight  # column-major in memory (decoder.use_column_major_linears)
    w_rows = w.contiguous()  # the same weight with rows contiguous, as nn.Linear stores it
    emb = decoder.embed_tokens.weight
    f = torch.nn.functional
    cases = [("lm_head linear [1,576]x[49152,576]^T", lambda: f.linear(x, emb))]
    for m in (1, 8, 512):
        xm = torch.randn(m, 576)
        cases.append((f"gate_up linear [{m},576]x[3072,576]^T, column-major", lambda xm=xm: f.linear(xm, w)))
        cases.append((f"gate_up linear [{m},576]x[3072,576]^T, row-major", lambda xm=xm: f.linear(xm, w_rows)))
    for name, fn in cases:
        for _ in range(5):
            fn()
        ts = []
        for _ in range(50):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        print(f"{name}: {med(ts):.3f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
