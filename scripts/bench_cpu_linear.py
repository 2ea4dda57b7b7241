"""Few-row linears on the CPU: F.linear (column-major weights, as the engine stores them) vs the packed panels of
model/cpu_linear.py, over 30 layers of the built-in model's linear shapes streamed from memory (as a decode step
reads them; one layer's weights alone would sit in cache), at rising row counts. Prints a table, writes JSON.

    .venv/bin/python scripts/bench_cpu_linear.py [--threads 2] [--out /tmp/cpu_linear.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts to measure, comma-separated")
    ap.add_argument("--repeats", type=int, default=7, help="timed passes per point (the median is reported)")
    ap.add_argument("--out", default="/tmp/cpu_linear.json", help="where to write the JSON results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pdserve.model import cpu_attention
    from pdserve.model.cpu_linear import pack

    lib = cpu_attention.decode_kernel()
    if lib is None:
        raise SystemExit("the CPU kernel library could not be built (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).t().contiguous().t() for n, k in SHAPES] for _ in range(LAYERS)]
    width = int(lib.pdserve_linear_panel_width())
    packed_weights = [[pack(w, width) for w in layer] for layer in weights]
    nbytes = sum(w.numel() * 4 for layer in weights for w in layer)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2] * 1000

    rows_out = []
    print(f"{LAYERS} layers x {len(SHAPES)} linears, {nbytes / 2**20:.0f} MiB of weights, {args.threads} threads")
    print(f"{'rows':>5} {'F.linear ms':>12} {'panels ms':>10} {'panels/F':>9} {'F GB/s':>7} {'panels GB/s':>11}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}

        def plain(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in weights:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def packed(xs: dict[int, torch.Tensor] = xs, m: int = m) -> None:
            for layer, packed_layer in zip(weights, packed_weights, strict=True):
                for w, wp in zip(layer, packed_layer, strict=True):
                    n, k = w.shape
                    x, y = xs[k], torch.empty(m, n)
                    args = (x.data_ptr(), m, k, x.stride(0), wp.data_ptr(), n, None, y.data_ptr(), n)
                    lib.pdserve_linear_panels_f32(*args)

        a, b = timed(plain), timed(packed)
        rows_out.append({"rows": m, "f_linear_ms": a, "panels_ms": b})
        print(f"{m:>5} {a:>12.1f} {b:>10.1f} {b / a:>9.2f} {nbytes / a / 1e6:>7.1f} {nbytes / b / 1e6:>11.1f}")
    with open(args.out, "w") as f:
        json.dump({"threads": args.threads, "weight_bytes": nbytes, "points": rows_out}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
