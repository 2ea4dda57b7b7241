"""P, D and the router on three "hosts": Linux network namespaces joined by veths on a bridge (tests/e2e/netns.py),
each with one non-loopback address, the client in the root namespace. Pull and push end to end through the
router with a deployment secret: greedy answers equal a colocated reference; every block is free afterwards;
the KV crossed the veth (D's received bytes on its interface cover the KV bytes it counted), so UCX went over
TCP between the hosts; nothing listens on loopback or on a wildcard address. The commands are the ones
docs/deploy.md gives for two real hosts.

Skipped, with the reason, where the machine does not allow namespaces (not root, no `ip`, `ip netns add` fails).
One P and one D per mode (an instance serves one mode) share the namespaces; all start at once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT, Launcher, Proc, post, scrape_metrics, wait_idle
from netns import Netns, NetnsUnavailable

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODES = ("pull", "push")
HTTP_PORTS = {"pull": 8000, "push": 8001}  # each namespace has its own port space: fixed ports are free
SIDE_CHANNEL_PORTS = {"pull": 5600, "push": 5601}
UCX_PORTS = (41000, 41099)  # UCX_TCP_PORT_RANGE: UCX's TCP listener takes a random free port from it
# UCX_TLS=tcp: namespaces share one kernel, so UCX counts P and D as one node and would move the KV with CMA
# (process_vm_readv/writev) past the veths; measured with UCX_PROTO_INFO=y, docs/deploy.md
UCX_ENV = {"UCX_TLS": "tcp", "UCX_TCP_PORT_RANGE": f"{UCX_PORTS[0]}-{UCX_PORTS[1]}"}
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 8}
# byte-level tokenizer: ~1 token per character; up to ~200 tokens = 100 KiB of KV (tiny llama: 512 B/token)
PROMPTS = ["Hello from another host", "The capital of France is " * 3, "a b c d e f g h i j " * 10]


@dataclass
class Cluster:
    net: Netns
    reference: Proc  # --kv-role both, root namespace (loopback)
    prefill: dict[str, Proc]  # mode -> P in namespace "p"
    decode: dict[str, Proc]  # mode -> D in namespace "d"
    router: dict[str, Proc]  # mode -> router in namespace "r"


@pytest.fixture(scope="module")
def net() -> Iterator[Netns]:
    try:
        topology = Netns.create(["p", "d", "r"])
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable here: {e}")
    try:
        yield topology
    finally:
        topology.close()


@pytest.fixture(scope="module")
def cluster(net: Netns, launcher: Launcher, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    # `launcher` is set up after `net`, so its processes stop before the namespaces go
    launcher.env.update(UCX_ENV)
    secret_file = tmp_path_factory.mktemp("netns") / "secret"
    secret_file.write_text("netns-test-deployment-secret-0123456789")
    secret_file.chmod(0o600)
    auth = ["--kv-auth-secret-file", str(secret_file)]
    reference = launcher.serve(tiny_llama, "--kv-role", "both", "--num-gpu-blocks", "64", name="reference")
    instances: dict[str, dict[str, Proc]] = {"p": {}, "d": {}}
    for mode in MODES:
        for host, role, block in (("p", "prefill", "16"), ("d", "decode", "32")):
            addr = net.hosts[host].address
            args = ["--kv-role", role, "--kv-transfer", mode, "--block-size", block, "--num-gpu-blocks", "64"]
            args += ["--kv-side-channel-host", addr, "--kv-side-channel-port", str(SIDE_CHANNEL_PORTS[mode])]
            instances[host][mode] = launcher.serve(
                tiny_llama, *args, *auth, name=f"{role}-{mode}", prefix=net.exec_prefix(host), host=addr,
                port=HTTP_PORTS[mode],
            )  # fmt: skip
    routers = {
        mode: launcher.proxy(
            mode,
            [instances["p"][mode]],
            [instances["d"][mode]],
            *auth,
            name=f"router-{mode}",
            prefix=net.exec_prefix("r"),
            host=net.hosts["r"].address,
            port=HTTP_PORTS[mode],
        )  # fmt: skip
        for mode in MODES
    }
    launcher.wait_ready()
    return Cluster(net, reference, instances["p"], instances["d"], routers)


def completions(url: str, prompts: list[str]) -> list[tuple[str, list[int]]]:
    """(text, token ids) for each prompt, sent concurrently."""

    def one(prompt: str) -> tuple[str, list[int]]:
        resp = post(url, "/v1/completions", {"prompt": prompt, **GREEDY})
        assert resp.status_code == 200, resp.text
        choice: dict[str, Any] = resp.json()["choices"][0]
        return choice["text"], choice["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("mode", MODES)
def test_pd_across_namespaces(cluster: Cluster, mode: str) -> None:
    p, d, router = cluster.prefill[mode], cluster.decode[mode], cluster.router[mode]
    received_before = scrape_metrics(d.url)["pdserve_kv_received_bytes_total"]
    rx_before = cluster.net.rx_bytes("d")

    assert completions(router.url, PROMPTS) == completions(cluster.reference.url, PROMPTS)

    for proc in (p, d):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], (proc.name, m)
    kv_bytes = scrape_metrics(d.url)["pdserve_kv_received_bytes_total"] - received_before
    rx_bytes = cluster.net.rx_bytes("d") - rx_before
    assert kv_bytes > 50_000, kv_bytes  # the prompts' KV moved (P->D), not recomputed on D
    # every KV byte arrived through D's veth (plus HTTP, the side channel and UCX's own headers)
    assert rx_bytes >= kv_bytes, (rx_bytes, kv_bytes)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listeners_on_the_hosts_addresses_only(cluster: Cluster) -> None:
    """HTTP, the side channel and UCX listen on each host's own address, UCX within UCX_TCP_PORT_RANGE."""
    for host in ("p", "d"):
        addr = cluster.net.hosts[host].address
        listeners = cluster.net.tcp_listeners(host)
        assert listeners and all(hp.startswith(f"{addr}:") for hp in listeners), (host, listeners)
        ports = {int(hp.rsplit(":", 1)[1]) for hp in listeners}
        fixed = set(HTTP_PORTS.values()) | set(SIDE_CHANNEL_PORTS.values())
        ucx = ports - fixed
        assert len(ucx) == len(MODES) and all(UCX_PORTS[0] <= port <= UCX_PORTS[1] for port in ucx), listeners
    router_addr = cluster.net.hosts["r"].address
    assert sorted(cluster.net.tcp_listeners("r")) == sorted(f"{router_addr}:{port}" for port in HTTP_PORTS.values())


def test_wildcard_side_channel_advertises_the_hosts_address(net: Netns) -> None:
    """A side channel bound to 0.0.0.0 advertises the address peers can dial: here the host name resolves to
    127.0.0.1 (/etc/hosts) and the namespace has no default route, so it is the veth's address."""
    code = "from pdserve.transfer.thread.handshake import SideChannel; s = SideChannel('0.0.0.0', 0); print(s.host)"
    argv = [*net.exec_prefix("p"), sys.executable, "-c", code]
    out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == net.hosts["p"].address, out.stdout
