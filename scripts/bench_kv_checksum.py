"""What --kv-checksum costs: TTFT and transfer time with and without it, per mode and prompt length, plus the
time of one checksum (transfer/checksum.py) over a prompt's KV on the cache's device.

Usage: .venv/bin/python scripts/bench_kv_checksum.py [--model tiny] [--lengths 4096 16384] [--requests 3]
           [--modes push pull] [--device cpu] [--out docs/results/cpu/kv_checksum.json]
       .venv/bin/python scripts/bench_kv_checksum.py --render docs/results/cpu/kv_checksum.json  (table again)

Per mode, two 1P1D deployments + router (pdserve.bench.deploy), one with --kv-checksum on both instances, one
without, all up for the whole run; requests alternate between them (off, on, off, on, ...) so both see the
same load. Prompts are fresh random token ids (no prefix hits; D runs without a prefix cache). From the
instances' own timelines (pdserve/bench/spans.py, derive): TTFT = P's arrival -> D's first token (server
side, no HTTP or router), transfer = the READ/WRITE posted -> D has the KV (reported to its engine), which
with the checksum includes P's sum
(push: before its WRITE; pull: in the answer to D's release) and D's sum and comparison. "sum" times
KVChecksum.part over the prompt's blocks of a cache of the served model's shape on --device (one side's sum;
median of 5). --model tiny writes a small Llama config (2 layers, 2 KV heads of 64, float32 on the CPU) and
serves it with dummy weights; any preset or folder works with --load-format dummy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.spans import derive, median, one_request, run_header, timelines

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 4096,
    "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SETTINGS = ("off", "on")


def model_config(model: str) -> dict[str, Any]:
    from pdserve.model.presets import get_preset, is_preset

    return get_preset(model) if is_preset(model) else json.loads((Path(model) / "config.json").read_text())


def time_sum(cfg: dict[str, Any], length: int, dtype: str, device: str, block_size: int) -> float:
    """Median ms of KVChecksum.part over `length` tokens (every KV head) of a cache of the model's shape."""
    import torch

    from pdserve.transfer.checksum import KVChecksum

    heads, layers = cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    num_blocks = -(-length // block_size) + 1
    kv = torch.randn(num_blocks, layers, 2, heads, block_size, head_dim, dtype=getattr(torch, dtype), device=device)
    ck, table = KVChecksum(kv), list(range(1, num_blocks))
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        ck.part([table], [(0, length - 1)], 0, heads)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def table(summary: list[dict[str, Any]]) -> list[str]:
    head = "| mode | prompt tokens | TTFT off ms | TTFT on ms | TTFT +% | transfer off ms | transfer on ms | sum ms |"
    lines = [head, "|" + "---|" * 8]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for c in summary:
        off, on = c["ttft_ms"]["off"], c["ttft_ms"]["on"]
        pct = None if off is None or on is None else 100 * (on - off) / off
        tr = c["transfer_ms"]
        lines.append(f"| {c['mode']} | {c['input_len']} | {f(off, 0)} | {f(on, 0)} | {f(pct)} | "
                     f"{f(tr['off'], 2)} | {f(tr['on'], 2)} | {f(c['sum_ms'], 2)} |")  # fmt: skip
    return lines


def render(path: str) -> int:
    result = json.loads(Path(path).read_text())
    print("\n".join(result["table"]))
    print(result["command"], result["date"], result["machine"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny', a preset or a model folder (served with dummy weights)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="prompt tokens")
    ap.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull"])
    ap.add_argument("--requests", type=int, default=3, help="measured requests per setting, mode and length")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests per setting, mode and length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="served dtype (default: the model's on CUDA, float32 on the CPU)")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--kv-cache-memory-gib", default="1")
    ap.add_argument("--extra", nargs="*", default=[], help="more `pdserve serve` flags for every instance")
    ap.add_argument("--log-dir", default="/tmp/pdserve-bench-kv-checksum")
    ap.add_argument("--out", default="docs/results/cpu/kv_checksum.json")
    ap.add_argument("--render", metavar="JSON", help="only print the table of a saved result")
    args = ap.parse_args()
    if args.render:
        return render(args.render)

    log_dir = Path(args.log_dir)
    model = args.model
    if model == "tiny":
        model = str(log_dir / "tiny-llama")
        Path(model).mkdir(parents=True, exist_ok=True)
        (Path(model) / "config.json").write_text(json.dumps(TINY))
    cfg = model_config(model)
    dtype = args.dtype or ("float32" if args.device == "cpu" else cfg.get("torch_dtype", "bfloat16"))
    vocab = cfg["vocab_size"]
    block_size = 16
    extra = ("--kv-cache-memory-gib", args.kv_cache_memory_gib, *args.extra)
    base = dict(model=model, load_format="dummy", dtype=dtype, num_threads=args.num_threads, device=args.device,
                max_model_len=max(args.lengths) + 16, block_size=block_size)  # fmt: skip
    deps = {
        (m, s): Deployment(
            ServerOptions(**base, extra_args=extra + (("--kv-checksum",) if s == "on" else ())), m, log_dir / s
        )  # fmt: skip
        for m in args.modes
        for s in SETTINGS
    }
    rng = random.Random(0)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    try:
        print(f"starting {len(deps)} deployments (logs in {log_dir})", flush=True)
        with ThreadPoolExecutor(len(deps)) as pool:
            list(pool.map(lambda d: d.start(), deps.values()))
        for length in args.lengths:
            for i in range(args.warmup + args.requests):
                for (m, s), dep in deps.items():  # interleaved: every setting sees the same load
                    prompt = [rng.randrange(10, vocab - 10) for _ in range(length)]
                    rid = f"{m}-{s}-{length}-{i}-{uuid.uuid4().hex[:8]}"
                    client = one_request(dep.router_url, prompt, 2, rid)
                    if i >= args.warmup:
                        rows.append({"mode": m, "setting": s, "input_len": length, "request_id": rid, **client})
            print(f"  {length} tokens done", flush=True)
        for (m, s), dep in deps.items():
            p_tl, d_tl = timelines(dep.prefill_url), timelines(dep.decode_url)
            for row in rows:
                if (row["mode"], row["setting"]) == (m, s):
                    row.update(derive(p_tl[row["request_id"]], d_tl[row["request_id"]]))
    finally:
        for dep in deps.values():
            dep.stop()
    load_after = os.getloadavg()
    device_name = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name(0)

    summary = []
    for length in args.lengths:
        sum_ms = time_sum(cfg, length, dtype, args.device, block_size)
        for m in args.modes:
            cell: dict[str, Any] = {"mode": m, "input_len": length, "sum_ms": sum_ms, "ttft_ms": {}, "transfer_ms": {}}
            for s in SETTINGS:
                rs = [r for r in rows if (r["mode"], r["setting"], r["input_len"]) == (m, s, length)]
                cell["ttft_ms"][s] = median(rs, "server_ttft_ms")
                cell["transfer_ms"][s] = median(rs, "transfer_posted_to_kv_received_ms")
            summary.append(cell)
    lines = table(summary)
    print(f"\nmedians over {args.requests} requests per cell (after {args.warmup} warm-up):")
    print("\n".join(lines))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cores)")
    result = {
        **run_header(load_before, load_after, device=args.device, device_name=device_name),
        "options": {k: v for k, v in vars(args).items() if k not in ("out", "render")},
        "model_config": cfg,
        "summary": summary,
        "requests": rows,
        "table": lines,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
