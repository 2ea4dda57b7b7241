"""How many long requests decode at once in a fixed KV budget: KV groups (windowed blocks freed) vs today's
full allocation (every layer in every block, nothing freed). Pure Python: the real Scheduler and BlockPool,
no model (CPU, seconds).

Capacity = requests added one at a time, each stepped until it decodes, before the next one no longer fits
(a preemption, or it cannot be admitted). Prints a table and writes JSON.

    .venv/bin/python scripts/bench_swa_capacity.py --presets gemma3-12b gemma3-27b --input-lens 4096 16384 \
        --kv-gib 40 --out swa_capacity.json
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.groups import KVGroups
from pdserve.model.arch import ModelArch
from pdserve.model.presets import get_preset
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.nop import NopScheduler

ELEM = 2  # bytes per element, bfloat16


def capacity(
    groups: KVGroups, arch: ModelArch, kv_gib: float, block_size: int, input_len: int, budget: int
) -> dict[str, int]:
    block_bytes = 2 * groups.layers_per_block * block_size * arch.num_kv_heads * arch.head_dim * ELEM
    num_blocks = int(kv_gib * 2**30 // block_bytes)
    pool = BlockPool(num_blocks, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=budget)
    sched = Scheduler(cfg, pool, block_size, 10**9, NopScheduler(block_size), groups)
    params = SamplingParams.greedy(10**6)
    n = 0
    while True:
        req = Request(f"r{n}", [5 + (n + i) % 1000 for i in range(input_len)], params, eos_token_ids=())
        sched.add(req)
        while req.num_computed_tokens < input_len:
            out = sched.schedule()
            if out.preempted_ids or out.out_of_blocks or not out.chunks:
                return {"num_blocks": num_blocks, "block_bytes": block_bytes, "requests": n}
            sched.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["gemma3-12b"])
    ap.add_argument("--input-lens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--kv-gib", type=float, default=40.0, help="KV cache budget (bfloat16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--out", default="swa_capacity.json")
    args = ap.parse_args()
    rows = []
    print(f"{'preset':<12} {'input':>6} {'groups':>6} {'full: reqs':>10} {'grouped: reqs':>13} {'gain':>6}")
    for name in args.presets:
        arch = ModelArch.from_hf_config(get_preset(name))
        grouped = KVGroups.of(arch.layer_windows, arch.num_layers)
        full = KVGroups.of((), arch.num_layers)  # today: every layer in every block, nothing freed
        for n in args.input_lens:
            a = capacity(full, arch, args.kv_gib, args.block_size, n, args.budget)
            b = capacity(grouped, arch, args.kv_gib, args.block_size, n, args.budget)
            gain = b["requests"] / max(1, a["requests"])
            print(f"{name:<12} {n:>6} {grouped.num_groups:>6} {a['requests']:>10} {b['requests']:>13} {gain:>5.2f}x")
            rows.append({"preset": name, "input_len": n, "kv_gib": args.kv_gib, "block_size": args.block_size,
                         "budget": args.budget, "num_groups": grouped.num_groups, "full": a, "grouped": b,
                         "gain": gain})  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
