"""vLLM interop, both ways, greedy output compared with colocated serving (`make interop`).

    python scripts/interop_vllm.py [--peer-dir ~/.cache/vllm-peer] [--out docs/results/cpu/interop.json]

(a) pdserve's pull router in front of two vLLM-CPU instances (NixlConnector, kv_buffer_device "cpu", each its
    own VLLM_NIXL_SIDE_CHANNEL_PORT): every prompt through `pdserve proxy --mode pull` and, as the reference,
    whole to the vLLM prefill instance (no kv_transfer_params: vLLM colocated). D's READs are confirmed by the
    growth of vLLM's `vllm:nixl_bytes_transferred` histogram on D's /metrics (one observation per READ).
(b) vLLM's proxy request flow against pdserve pull instances (with a deployment secret, as `pdserve demo`
    runs them): P gets the body with max_tokens 1 and the kv_transfer_params vLLM's toy proxy sends
    ({"do_remote_decode": true, the rest null}); D gets the body plus P's answer verbatim. Reference: the
    same prompt whole to the pdserve prefill instance (pdserve colocated) and vLLM's answers from (a).
    D's READs: pdserve_kv_transfers_total{result="ok"} and pdserve_kv_received_bytes_total on D's /metrics.

Prompts are token ids (seeded, unique: no prefix-cache shortcut, which is off on every instance anyway) of
several lengths, most longer than one block on both engines. Greedy (temperature 0, ignore_eos), token ids
compared. Servers listen on 127.0.0.1, on free ports; every process is stopped at the end, also on an error,
Ctrl-C or SIGTERM. Prints a table, writes the JSON, exits 1 on any mismatch or unconfirmed transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pdserve.auth import new_secret
from pdserve.bench.procs import ManagedProcess, free_ports

ROOT = Path(__file__).resolve().parent.parent  # the checkout: scripts/vllm_peer/, docs/results/

MODEL = "smollm2-135m"  # the name every server answers to
VOCAB = 49152  # SmolLM2
LENGTHS = (5, 40, 200, 333, 700)  # prompt tokens; pdserve's blocks hold 16, vLLM-CPU's 128
MAX_TOKENS = 16
TOY_PROXY_P_PARAMS = {  # what vLLM's toy proxy (tests/v1/kv_connector/nixl_integration) sends to P
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in LENGTHS]


def post(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def completion(base_url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": False, **extra}  # fmt: skip
    return post(f"{base_url}/v1/completions", body)


def output_ids(answer: dict[str, Any]) -> list[int] | str:
    """The choice's token ids (its text when a server gives none)."""
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else str(choice["text"])


def metric_sum(base_url: str, name: str, label: str = "") -> float:
    """Sum of every sample of `name` (every label set, or only those containing `label`) on /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(base_url: str, name: str, at_least: float, timeout_s: float = 60.0) -> float:
    """vLLM publishes connector stats with the engine's step stats: poll until they arrive (or give up)."""
    deadline = time.monotonic() + timeout_s
    value = metric_sum(base_url, name)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(1.0)
        value = metric_sum(base_url, name)
    return value


class Servers:
    """Starts servers on free loopback ports; `stop()` (also from the ExitStack) stops them, last first."""

    def __init__(self, log_dir: Path, startup_timeout_s: float) -> None:
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.procs: list[ManagedProcess] = []

    def start(self, name: str, argv: list[str], env: dict[str, str], port: int) -> str:
        self.procs.append(ManagedProcess(name, argv, self.log_dir / f"{name}.log", env))
        return f"http://127.0.0.1:{port}"

    def wait(self, urls: list[str]) -> None:
        for proc, url in zip(self.procs[-len(urls) :], urls, strict=True):
            proc.wait_healthy(url + "/health", self.startup_timeout_s)

    def stop(self) -> None:
        while self.procs:
            self.procs.pop().stop()


def vllm_argv(peer: Path, port: int) -> list[str]:
    kv_config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return [str(peer / "venv/bin/python"), str(ROOT / "scripts/vllm_peer/vllm_cli.py"), "serve",
            str(peer / "smollm2-hf"), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
            "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv_config)]  # fmt: skip


def vllm_env(peer: Path, side_port: int, core: int) -> dict[str, str]:
    """One core per instance (P the first, D the last), so the two OpenMP pools do not fight over one."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
           "UCX_NET_DEVICES": "lo"}  # fmt: skip
    iomp = peer / "venv/lib/libiomp5.so"  # the wheel's OpenMP runtime, faster here than GNU's
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def pdserve_argv(role: str, port: int, side_port: int, secret_file: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--kv-role", role, "--kv-transfer", "pull", "--kv-side-channel-port", str(side_port),
            "--kv-auth-secret-file", str(secret_file), "--num-threads", "1", "--no-enable-prefix-caching",
            "--max-model-len", "2048"]  # fmt: skip


def run_vllm_behind_router(servers: Servers, peer: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """(a): pdserve proxy --mode pull -> vLLM P + vLLM D; reference: the same prompts whole to vLLM P."""
    p_port, d_port, p_side, d_side, r_port = free_ports(5)
    cores = sorted(os.sched_getaffinity(0))
    p_url = servers.start("vllm_prefill", vllm_argv(peer, p_port), vllm_env(peer, p_side, cores[0]), p_port)
    d_url = servers.start("vllm_decode", vllm_argv(peer, d_port), vllm_env(peer, d_side, cores[-1]), d_port)
    servers.wait([p_url, d_url])
    router_argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--mode", "pull", "--host", "127.0.0.1",
                   "--port", str(r_port), "--prefill", p_url, "--decode", d_url]  # fmt: skip
    r_url = servers.start("router_pull", router_argv, {}, r_port)
    servers.wait([r_url])
    reads0 = metric_sum(d_url, "vllm:nixl_bytes_transferred_count")
    bytes0 = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    failed0 = metric_sum(d_url, "vllm:nixl_num_failed_transfers_total")
    rows = []
    for prompt in prompts:
        reference = output_ids(completion(p_url, prompt))
        routed = output_ids(completion(r_url, prompt))
        rows.append({"prompt_len": len(prompt), "identical": routed == reference, "output": routed,
                     "reference": reference})  # fmt: skip
    reads = wait_for_metric(d_url, "vllm:nixl_bytes_transferred_count", reads0 + len(prompts)) - reads0
    num_bytes = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") - bytes0
    failed = metric_sum(d_url, "vllm:nixl_num_failed_transfers_total") - failed0
    return {
        "direction": "pdserve router -> vLLM P/D",
        "reference": "vLLM colocated (the prefill instance, whole requests)",
        "prompts": rows,
        "num_identical": sum(r["identical"] for r in rows),
        "d_reads": reads,
        "d_read_bytes": num_bytes,
        "d_failed_transfers": failed,
        "transfer_confirmed": reads >= len(prompts) and num_bytes > 0 and failed == 0,
    }


def run_vllm_proxy_flow(
    servers: Servers, prompts: list[list[int]], vllm_outputs: list[Any] | None, secret_file: Path
) -> dict[str, Any]:
    """(b): vLLM's proxy request flow against pdserve pull P + D; references: pdserve and vLLM colocated."""
    p_port, d_port, p_side, d_side = free_ports(4)
    p_url = servers.start("pdserve_prefill", pdserve_argv("prefill", p_port, p_side, secret_file), {}, p_port)
    d_url = servers.start("pdserve_decode", pdserve_argv("decode", d_port, d_side, secret_file), {}, d_port)
    servers.wait([p_url, d_url])
    ok0 = metric_sum(d_url, "pdserve_kv_transfers_total", 'result="ok"')
    bytes0 = metric_sum(d_url, "pdserve_kv_received_bytes_total")
    rows = []
    for i, prompt in enumerate(prompts):
        reference = output_ids(completion(p_url, prompt))
        first = completion(p_url, prompt, max_tokens=1, kv_transfer_params=TOY_PROXY_P_PARAMS)
        params = first.get("kv_transfer_params")
        routed = output_ids(completion(d_url, prompt, kv_transfer_params=params))
        row = {"prompt_len": len(prompt), "identical": routed == reference, "output": routed,
               "reference": reference, "p_answer_keys": sorted(params or {})}  # fmt: skip
        if vllm_outputs is not None:
            row["identical_to_vllm"] = routed == vllm_outputs[i]
        rows.append(row)
    reads = metric_sum(d_url, "pdserve_kv_transfers_total", 'result="ok"') - ok0
    num_bytes = metric_sum(d_url, "pdserve_kv_received_bytes_total") - bytes0
    return {
        "direction": "vLLM proxy flow -> pdserve P/D",
        "reference": "pdserve colocated (the prefill instance, whole requests)",
        "prompts": rows,
        "num_identical": sum(r["identical"] for r in rows),
        "d_reads": reads,
        "d_read_bytes": num_bytes,
        "transfer_confirmed": reads >= len(prompts) and num_bytes > 0,
    }


def write_secret(path: Path) -> Path:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    return path


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'direction':34} {'prompts':>7} {'identical':>9} {'transfer confirmed':>19}")
    for r in results:
        n = len(r["prompts"])
        print(f"{r['direction']:34} {n:>7} {r['num_identical']:>6}/{n:<2} {str(r['transfer_confirmed']):>19}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-dir", type=Path, default=Path(os.environ.get("PEER_DIR", "~/.cache/vllm-peer")))
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/cpu/interop.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/pdserve-interop"))
    ap.add_argument("--startup-timeout-s", type=float, default=1200.0, help="per server (vLLM-CPU starts slowly)")
    ap.add_argument("--seed", type=int, default=15)
    args = ap.parse_args()
    peer = args.peer_dir.expanduser()
    if not (peer / "smollm2-hf/config.json").exists():
        print(f"no vLLM peer in {peer}: run scripts/vllm_peer/setup.sh (make interop does)", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the ExitStack: servers stopped
    prompts = make_prompts(args.seed)
    results = []
    with ExitStack() as stack:
        servers = Servers(args.log_dir, args.startup_timeout_s)
        stack.callback(servers.stop)
        results.append(run_vllm_behind_router(servers, peer, prompts))
        servers.stop()  # one engine pair at a time on this machine
        vllm_outputs = [row["reference"] for row in results[0]["prompts"]]
        secret = write_secret(args.log_dir / "kv_auth_secret")
        results.append(run_vllm_proxy_flow(servers, prompts, vllm_outputs, secret))
    print_table(results)
    ok = all(r["transfer_confirmed"] and r["num_identical"] == len(r["prompts"]) for r in results)
    summary = {
        "what": "vLLM interop both ways (scripts/interop_vllm.py, `make interop`): greedy token ids vs colocated",
        "vllm": "vllm-cpu 0.32.0, NixlConnector, kv_buffer_device cpu",
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "ok": ok,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'all identical, transfers confirmed' if ok else 'MISMATCH or unconfirmed transfer'} -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
