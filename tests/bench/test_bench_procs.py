"""Process handling of the sweep: every started process, and what it started, is gone after stop()."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.cli_sweep import parse_attach
from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.procs import ManagedProcess, descendants, free_ports
from pdserve.bench.sweep_config import format_qps, point_stem


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_stop_kills_the_group_and_escaped_descendants(tmp_path: Path) -> None:
    # a child ignoring SIGTERM, a grandchild in the group, and one that left the group with setsid
    script = "trap '' TERM; sleep 60 & setsid sleep 61 & sleep 62"
    proc = ManagedProcess("stubborn", ["bash", "-c", script], tmp_path / "logs" / "p.log")
    _wait_for(lambda: len(descendants(proc.pid)) >= 3)
    family = [proc.pid, *descendants(proc.pid)]
    start = time.monotonic()
    proc.stop(grace_s=0.5)
    assert time.monotonic() - start < 5
    _wait_for(lambda: not any(_alive(pid) for pid in family))
    assert "$ bash -c" in (tmp_path / "logs" / "p.log").read_text()


def test_wait_healthy_reports_an_early_exit(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"], tmp_path / "b.log"
    )
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*no model here"):
        proc.wait_healthy(f"http://127.0.0.1:{free_ports(1)[0]}/health", timeout_s=30)
    proc.stop()


def test_free_ports_are_distinct_and_outside_the_kernels_range() -> None:
    ports = free_ports(5) + free_ports(5)  # distinct across calls too, not only within one
    assert len(set(ports)) == 10 and all(p > 0 for p in ports)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    assert not any(low <= p <= high for p in ports)  # never one the kernel may give to a bind(0) or a connect


def test_proxy_on_port_zero_reports_the_port_it_bound(tmp_path: Path) -> None:
    log_path = tmp_path / "router.log"
    log_path.write_text("pdserve proxy: listening on http://127.0.0.1:1\n")  # an earlier run's line (appended)
    (dead,) = free_ports(1)
    argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--mode", "colocated", "--port", "0"]
    proc = ManagedProcess("router", [*argv, "--instance", f"http://127.0.0.1:{dead}"], log_path)
    try:
        port = proc.wait_port(timeout_s=60)
        assert port != 1
        deadline = time.monotonic() + 60
        while True:  # the router answers on that port: its /health is a 503 naming the dead instance given
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "router never answered"
                time.sleep(0.1)
        assert resp.status_code == 503 and f"http://127.0.0.1:{dead}" in resp.json()["error"]["message"]
    finally:
        proc.stop()


def test_result_names() -> None:
    assert point_stem("push", 1.0, 512, 64, 0) == "push_qps1_in512_out64_iter0"
    assert point_stem("pull", 0.5, 128, 8, 2) == "pull_qps0.5_in128_out8_iter2"
    assert format_qps(math.inf) == "inf"


def test_parse_attach() -> None:
    attach = parse_attach(["push=http://a:1", "pull=http://b:2,http://p:3,http://d:4"])
    assert attach["push"].router_url == "http://a:1" and attach["push"].prefill_url is None
    assert (attach["pull"].prefill_url, attach["pull"].decode_url) == ("http://p:3", "http://d:4")
    with pytest.raises(ValueError):
        parse_attach(["both=http://a:1"])


def test_descendants_of_self_excludes_unrelated() -> None:
    assert os.getppid() not in descendants(os.getpid())


def test_deployment_command_lines(tmp_path: Path) -> None:
    options = ServerOptions(
        model="qwen3-8b", load_format="dummy", dtype="bfloat16", device="cuda", prefill_gpu=0, decode_gpu=1
    )
    d = Deployment(options, "push", tmp_path)
    prefill = d._serve_argv("prefill", 8100, 5600)
    decode = d._serve_argv("decode", 8200, 5601)
    head = ["qwen3-8b", "--host", "127.0.0.1", "--port", "8100", "--kv-role", "prefill", "--kv-transfer", "push"]
    assert prefill[prefill.index("serve") + 1 :][:11] == [*head, "--kv-side-channel-port", "5600"]
    assert decode[decode.index("--kv-role") + 1] == "decode"
    assert "--no-enable-prefix-caching" in decode and "--no-enable-prefix-caching" not in prefill
    for argv in (prefill, decode):
        value = {flag: argv[argv.index(flag) + 1] for flag in ("--device", "--dtype", "--load-format")}
        assert value == {"--device": "cuda", "--dtype": "bfloat16", "--load-format": "dummy"}
        assert "--num-threads" not in argv  # unset options keep the server's defaults
    assert d._gpu_env(options.prefill_gpu) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert d._gpu_env(options.decode_gpu) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert d._gpu_env(None) is None
