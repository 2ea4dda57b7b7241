"""KV moved per request by a sliding-window model against the same shape with full attention on every layer:
1P1D through the router, push and pull, bytes and transfer time per request at each input length.

    python scripts/bench_swa_transfer.py [--preset gemma3-12b] [--input-lens 4096,16384] [--requests 4]
        [--device cuda --prefill-gpu 0 --decode-gpu 1 --dtype bfloat16] [--server-arg=--kv-cache-memory-gib=16]
        [--out swa_transfer.json]

The preset is written as a model folder (scripts/dummy_model_dir.py, random weights); its twin is the same
folder with `layer_types` set to full attention on every layer. For each variant and mode a real deployment
(`pdserve.bench.deploy`: P, D and router processes) serves --requests prompts of each length one at a time
(max_tokens 2). Per request, from the instances' /metrics before and after: bytes D received
(pdserve_kv_received_bytes_total) and the transfer's duration (pdserve_kv_transfer_seconds: D's READ in pull
mode, P's WRITE in push mode). Prints a table of medians and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.scrape import scrape_metrics


def _transfer(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(bytes D received, seconds of the transfers observed on P and D) between two scrapes of both."""
    got = after["d"]["pdserve_kv_received_bytes_total"] - before["d"]["pdserve_kv_received_bytes_total"]
    secs = count = 0.0
    for side in ("p", "d"):
        secs += after[side]["pdserve_kv_transfer_seconds_sum"] - before[side]["pdserve_kv_transfer_seconds_sum"]
        count += after[side]["pdserve_kv_transfer_seconds_count"] - before[side]["pdserve_kv_transfer_seconds_count"]
    return got, secs / count if count else float("nan")


def _variants(preset: str, root: Path) -> dict[str, Path]:
    windowed = root / f"{preset}-windowed"
    subprocess.run([sys.executable, str(Path(__file__).with_name("dummy_model_dir.py")), preset, str(windowed)],
                   check=True, capture_output=True)  # fmt: skip
    full = root / f"{preset}-full"
    shutil.copytree(windowed, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"windowed": windowed, "full": full}


def _serve(dep: Deployment, lens: list[int], requests: int, vocab: int, rng: random.Random) -> list[dict[str, Any]]:
    urls = {"p": dep.prefill_url, "d": dep.decode_url}
    rows = []
    for n in lens:
        sizes, times = [], []
        for _ in range(requests + 1):  # the first is a warm-up (handshake, first use of the shapes)
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            before = {k: scrape_metrics(u) for k, u in urls.items()}
            body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
            resp = httpx.post(dep.router_url + "/v1/completions", json=body, timeout=600, trust_env=False)
            resp.raise_for_status()
            time.sleep(0.5)  # P's side of the transfer ends after D's answer: let both publish their stats
            got, secs = _transfer(before, {k: scrape_metrics(u) for k, u in urls.items()})
            sizes.append(got)
            times.append(secs)
        rows.append(
            {
                "input_len": n,
                "mb_per_request": statistics.median(sizes[1:]) / 1e6,
                "transfer_ms": statistics.median(times[1:]) * 1e3,
                "samples_mb": [s / 1e6 for s in sizes[1:]],
                "samples_ms": [t * 1e3 for t in times[1:]],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gemma3-12b", help="a windowed shape preset (dummy_model_dir.py names)")
    ap.add_argument("--input-lens", default="4096,16384", help="comma-separated prompt lengths, tokens")
    ap.add_argument("--requests", type=int, default=4, help="measured requests per length (after one warm-up)")
    ap.add_argument("--modes", default="push,pull", help="comma-separated transfer modes")
    ap.add_argument("--device", default=None, help="cpu or cuda (the server's default when omitted)")
    ap.add_argument("--prefill-gpu", type=int, default=None, help="CUDA_VISIBLE_DEVICES of P")
    ap.add_argument("--decode-gpu", type=int, default=None, help="CUDA_VISIBLE_DEVICES of D")
    ap.add_argument("--dtype", default=None, help="model and KV dtype")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to both servers (repeatable)")
    ap.add_argument("--out", default="swa_transfer.json", help="JSON written here")
    a = ap.parse_args()
    lens = [int(x) for x in a.input_lens.split(",")]
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for variant, folder in _variants(a.preset, root).items():
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            opts = ServerOptions(
                model=str(folder),
                dtype=a.dtype,
                load_format="dummy",
                device=a.device,
                prefill_gpu=a.prefill_gpu,
                decode_gpu=a.decode_gpu,
                max_model_len=max(lens) + 64,
                extra_args=tuple(a.server_arg),
            )
            for mode in a.modes.split(","):
                print(f"[{variant} {mode}] starting P, D and router", flush=True)
                with Deployment(opts, mode, root / "logs") as dep:
                    for row in _serve(dep, lens, a.requests, vocab, rng):
                        results.append({"variant": variant, "mode": mode, **row})
    print(f"\n{a.preset}: KV moved per request, median of {a.requests}")
    print(f"{'variant':>9} {'mode':>5} {'input':>6} {'MB':>9} {'ms':>8} {'GB/s':>6}")
    for r in results:
        gbps = r["mb_per_request"] / r["transfer_ms"] if r["transfer_ms"] else float("nan")
        print(
            f"{r['variant']:>9} {r['mode']:>5} {r['input_len']:>6} {r['mb_per_request']:>9.1f}"
            f" {r['transfer_ms']:>8.2f} {gbps:>6.1f}"
        )
    Path(a.out).write_text(json.dumps({"preset": a.preset, "args": vars(a), "rows": results}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
