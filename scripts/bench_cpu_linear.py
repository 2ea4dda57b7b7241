"""CPU linears: F.linear (column-major weights, as the engine stores them) vs the packed copies of
model/cpu/linear.py (MKL's packed GEMM, oneDNN's prepacked linear, and the column panels of csrc/small_gemm.c),
over 30 layers of the built-in model's linear shapes streamed from memory (as a step reads them; one layer's
weights alone would sit in cache), at rising row counts: decode batches up to prefill chunks. Each point is
measured in interleaved rounds (every variant once per round) and the median of rounds is reported.
Prints a table, writes JSON.

    .venv/bin/python scripts/bench_cpu_linear.py [--threads 2] [--out /tmp/cpu_linear.json]
    .venv/bin/python scripts/bench_cpu_linear.py --hints 1,16,128,512,2048   # MKL's packing row hint instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
LAYERS = 30


def _ms(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,2048", help="row counts to measure, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point (the median is reported)")
    ap.add_argument(
        "--hints", default="", help="compare MKL packings made for these row counts (comma-separated) instead"
    )
    ap.add_argument("--out", default="/tmp/cpu_linear.json", help="where to write the JSON results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pdserve.model.cpu import kernels as cpu_kernels
    from pdserve.model.cpu import linear as cpu_linear

    lib, mkl = cpu_kernels.library(), cpu_linear.mkl_packed_gemm()
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).t().contiguous().t() for n, k in SHAPES] for _ in range(LAYERS)]
    nbytes = sum(w.numel() * 4 for layer in weights for w in layer)

    def packed_with(linears: cpu_linear.PackedLinears) -> cpu_linear.PackedLinears:
        for li, layer in enumerate(weights):
            for wi, w in enumerate(layer):
                linears.add(f"{li}.{wi}", w)
        return linears

    variants: dict[str, cpu_linear.PackedLinears | None] = {}
    if args.hints:
        if mkl is None:
            raise SystemExit("this torch build has no MKL packed GEMM")
        for hint in (int(h) for h in args.hints.split(",")):
            variants[f"mkl@{hint}"] = packed_with(cpu_linear.PackedLinears("mkl", None, mkl, rows_hint=hint))
    else:
        variants["F.linear"] = None
        if mkl is not None:
            variants["mkl"] = packed_with(cpu_linear.PackedLinears("mkl", None, mkl))
        if cpu_linear.onednn_available():
            variants["onednn"] = packed_with(cpu_linear.PackedLinears("onednn"))
        if lib is not None:
            variants["panels"] = packed_with(cpu_linear.PackedLinears("panels", lib))
        if len(variants) == 1:
            raise SystemExit("neither MKL's packed GEMM nor the kernel library is available")

    def product(linears: cpu_linear.PackedLinears | None, xs: dict[int, torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for li, layer in enumerate(weights):
                for wi, w in enumerate(layer):
                    x = xs[w.shape[1]]
                    if linears is None or not linears.takes(x.shape[0]):
                        F.linear(x, w)
                    else:
                        linears.linear(f"{li}.{wi}", x, w)

        return run

    names = list(variants)
    print(f"{LAYERS} layers x {len(SHAPES)} linears, {nbytes / 2**20:.0f} MiB of weights, {args.threads} threads")
    print(
        f"{'rows':>5} "
        + " ".join(f"{name + ' ms':>13}" for name in names)
        + "   (a variant that does not take a row count runs F.linear)"
    )
    points = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        runs = {name: product(linears, xs) for name, linears in variants.items()}
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, run in runs.items():
                times[name].append(_ms(run))
        point = {"rows": m, **{f"{name}_ms": statistics.median(t) for name, t in times.items()}}
        points.append(point)
        print(f"{m:>5} " + " ".join(f"{point[name + '_ms']:>13.1f}" for name in names))
    with open(args.out, "w") as f:
        json.dump({"threads": args.threads, "weight_bytes": nbytes, "variants": names, "points": points}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
