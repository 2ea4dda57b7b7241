"""Push's hand-over on P, prepared vs laid out at the prefill's end: the time from the transfer thread taking the
finished prefill (P's "send_taken") to its WRITE posted ("transfer_posted"), one request at a time.

    python scripts/bench_handover.py [--shape qwen3-0.6b] [--layers 2] [--tokens 16384] [--block-size 16]
        [--repeat 10] [--device cpu | --device cuda] [--out handover.json]

One P and one D connector pair (pdserve/testing/transfer_pair.py: processes driven like the engine drives them),
push mode. Each repeat: D registers a request's blocks (a random permutation of its pool: about one descriptor
per block, the fragmented case), then P, in turn "prepared" and "at end": prepared: P is told its blocks as the
engine tells it when the prompt's last chunk is scheduled (StepMeta.planned: thread/push_prepare.py lays the WRITE
out then), and the script waits for P's "write_prepared" before finishing the prefill; at end: P is told nothing
before the prefill's end (the WRITE is laid out after "send_taken", as before issue 28 item 2, and as for a
registration that arrives after the prefill ended). D's blocks are checked against P's on the first repeat. The
descriptor count does not depend on the number of layers (a whole block is one range): --layers keeps the CPU's
caches small. Prints medians and writes JSON; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from pdserve.testing.transfer_pair import Instance, close_all, events, push_params, start_all


def shape_of(name: str) -> tuple[int, int, int, str]:
    from pdserve.model.arch import ModelArch
    from pdserve.model.presets import get_preset

    arch = ModelArch.from_hf_config(get_preset(name))
    return arch.num_layers, arch.num_kv_heads, arch.head_dim, "bfloat16"


def wait(what: str, pred: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.001)


def one(p: Instance, d: Instance, rid: str, p_blocks: list[int], d_blocks: list[int], tokens: int, prepared: bool,
        check: bool) -> dict[str, float]:  # fmt: skip
    """One request of `tokens` prompt tokens (D takes them all: P hands its first token over); P's events (ms from
    send_taken) and the split."""
    pa, da = push_params(p, rid)
    p.call("needs", f"p-{rid}", pa)
    if prepared:
        p.call("scheduled", f"p-{rid}", p_blocks, tokens, pa)
    d.call("needs", f"d-{rid}", da)
    d.call("alloc", f"d-{rid}", d_blocks, 0, tokens)
    wait("P holds the registration", lambda: "prefill_queued" in events(d, f"d-{rid}"))
    if prepared:
        wait("write_prepared", lambda: "write_prepared" in events(p, f"p-{rid}"))
    p.call("finish", f"p-{rid}", p_blocks, tokens, pa)
    kind, reason = d.wait_result(f"d-{rid}", timeout=120)
    if kind != "finished":
        raise RuntimeError(f"{rid}: {kind} {reason}")
    p.wait_send(f"p-{rid}", timeout=120)
    if check:  # every block D received holds P's bytes (the last one padded whole: layout.pad_last_blocks)
        n = -(-tokens // p.block_size)
        if p.call("block_sums", p_blocks[:n]) != d.call("block_sums", d_blocks[:n]):
            raise RuntimeError(f"{rid}: D's blocks differ from P's")
    ev = events(p, f"p-{rid}")
    taken = ev["send_taken"]
    return {"taken_to_posted_ms": 1e3 * (ev["transfer_posted"] - taken),
            "layout_ms": 1e3 * (ev["write_descriptors"] - taken) if "write_descriptors" in ev else 0.0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep it)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda (VRAM; P and D on GPU 0)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    layers, heads, head_dim, dtype = shape_of(args.shape)
    layers = args.layers or layers
    num_blocks = -(-args.tokens // args.block_size) + 8
    common = dict(block_size=args.block_size, num_blocks=num_blocks, dims=(layers, heads, head_dim), dtype=dtype,
                  device=args.device, fill="random")  # fmt: skip
    insts = start_all(p=Instance("prefill", "push", **common), d=Instance("decode", "push", **common))
    rnd = random.Random(0)
    rows: dict[str, list[dict[str, float]]] = {"prepared": [], "at end": []}
    try:
        for i in range(args.repeat + 1):  # the first pair warms both up
            for prepared in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                p_blocks = rnd.sample(range(num_blocks), num_blocks)
                d_blocks = rnd.sample(range(num_blocks), num_blocks)
                rid = f"h{i}{'p' if prepared else 'e'}"
                r = one(insts["p"], insts["d"], rid, p_blocks, d_blocks, args.tokens, prepared, check=i == 0)
                if i:
                    rows["prepared" if prepared else "at end"].append(r)
    finally:
        close_all(insts)
    out = {"args": vars(args), "layers": layers, "kv_heads": heads, "head_dim": head_dim, "dtype": dtype}
    for name, rs in rows.items():
        t = sorted(r["taken_to_posted_ms"] for r in rs)
        out[name] = {"taken_to_posted_ms_median": statistics.median(t), "min": t[0], "max": t[-1],
                     "layout_ms_median": statistics.median(r["layout_ms"] for r in rs), "runs": rs}  # fmt: skip
        print(f"{name:9} send_taken -> WRITE posted: median {statistics.median(t):.3f} ms (min {t[0]:.3f}, max "
              f"{t[-1]:.3f}; of it laying out {out[name]['layout_ms_median']:.3f} ms), {len(t)} requests")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
