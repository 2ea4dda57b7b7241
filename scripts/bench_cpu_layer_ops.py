"""The fused CPU layer ops (model/cpu/layer_ops.py) against the portable torch ops, A/B in one process.

    .venv/bin/python scripts/bench_cpu_layer_ops.py [--threads 2] [--rounds 7]

Bare ops at the built-in model's shapes (SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536)
for 512 rows (a prefill) and 1 and 8 rows (decode): add + RMSNorm (portable, torch's F.rms_norm, fused), rotary
+ KV store, SiLU-and-mul, and the prefill's SDPA with K/V repeated per query head or read through enable_gqa.
Then the engine: TTFT of a 512-token prompt and batch-1 decode with Decoder.use_cpu_layer_ops on and off (the
attention kernel on in both). Every pair alternates, round after round; min and median of the rounds are
printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, the mean of `reps` calls."""
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def report(name: str, samples: dict[str, list[float]], unit: float, label: str) -> None:
    base = statistics.median(next(iter(samples.values())))
    cells = []
    for k, v in samples.items():
        med = statistics.median(v)
        cells.append(f"{k} {min(v) * unit:8.1f} / {med * unit:8.1f} ({base / med:4.2f}x)")
    print(f"{name:<26} {label} min/median: " + " | ".join(cells))


def bare_ops(rows: int, rounds: int) -> None:
    from pdserve.model.cpu import kernels as cpu_kernels
    from pdserve.model.cpu import layer_ops as ops
    from pdserve.model.decoder_layer import RMSNorm
    from pdserve.model.paged import layer_view, write_kv
    from pdserve.model.rotary import apply_rope

    lib = cpu_kernels.library()
    assert lib is not None
    hidden, heads, kv_heads, hd, inter = 576, 9, 3, 64, 1536
    norm = RMSNorm(hidden, 1e-5)
    x, res = torch.randn(rows, hidden), torch.randn(rows, hidden)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd)
    pos = torch.arange(rows)
    freqs = pos.float().unsqueeze(-1) / (10000.0 ** (torch.arange(0, hd, 2) / hd))
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    kv = torch.zeros(rows // 16 + 1, 30, 2, kv_heads, 16, hd)
    cache, slots = layer_view(kv, 3), torch.arange(rows)
    gate_up = torch.randn(rows, 2 * inter)
    qs, ks, vs = torch.randn(1, heads, rows, hd), torch.randn(1, kv_heads, rows, hd), torch.randn(1, kv_heads, rows, hd)
    reps = max(3, 20000 // rows)

    def portable_norm() -> object:
        return norm(x + res)

    def torch_rms_norm() -> object:
        return F.rms_norm(x + res, (hidden,), norm.weight, norm.eps)

    def portable_rope() -> object:
        qk = qkv[:, : (heads + kv_heads) * hd].view(rows, heads + kv_heads, hd)
        q, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)
        write_kv(cache, k, qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd), slots)
        return q

    def portable_act() -> object:
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    pairs: dict[str, dict[str, Callable[[], object]]] = {
        "add+rmsnorm": {
            "portable": portable_norm,
            "F.rms_norm": torch_rms_norm,
            "fused": lambda: ops.add_rmsnorm(lib, x, res, norm.weight, norm.eps),
        },
        "rope+kv store": {
            "portable": portable_rope,
            "fused": lambda: ops.qkv_rope_store(lib, qkv, cos, sin, None, None, 1e-5, cache, slots, heads, kv_heads),
        },
        "silu*up": {"portable": portable_act, "fused": lambda: ops.act_and_mul(lib, gate_up)},
        "prefill sdpa": {  # attention.py's prefill: K/V repeated per query head, or read through enable_gqa
            "repeat": lambda: F.scaled_dot_product_attention(
                qs, ks.repeat_interleave(3, dim=1), vs.repeat_interleave(3, dim=1), is_causal=True
            ),
            "enable_gqa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
        },
    }
    with torch.inference_mode():
        for name, fns in pairs.items():
            samples: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(rounds):
                for k, fn in fns.items():
                    samples[k].append(timeit(fn, reps))
            report(f"{name} ({rows} rows)", samples, 1e6, "us")


def engine(rounds: int, input_len: int, output_len: int) -> None:
    from pdserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", enable_prefix_caching=False)
    decoder = llm.engine.runner.decoder
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size

    def run(fused: bool, max_new: int) -> tuple[float, float]:
        decoder.use_cpu_layer_ops = fused
        prompt = torch.randint(100, vocab - 100, (1, input_len), generator=g).tolist()
        t0 = time.perf_counter()
        (out,) = llm.generate(prompt, SamplingParams.greedy(max_new, ignore_eos=True))
        total = time.perf_counter() - t0
        ttft = out.timeline["first_token"] - out.timeline["arrival"]
        return ttft, (total - ttft) / (max_new - 1)

    run(True, 4), run(False, 4)  # warm-up both
    ttft: dict[str, list[float]] = {"fused": [], "portable": []}
    tpot: dict[str, list[float]] = {"fused": [], "portable": []}
    for _ in range(rounds):
        for name, fused in (("fused", True), ("portable", False)):
            a, b = run(fused, output_len)
            ttft[name].append(a)
            tpot[name].append(b)
    report(f"TTFT ({input_len} tokens)", ttft, 1e3, "ms")
    report("batch-1 decode step", tpot, 1e3, "ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--skip-bare", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_bare:
        for rows in (512, 8, 1):
            bare_ops(rows, args.rounds)
    engine(args.rounds, args.input_len, args.output_len)


if __name__ == "__main__":
    main()
