"""UCX (NIXL's data plane) listens only where the operator says: the side channel's interface by default."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from pdserve.testing.transfer_pair import Instance
from pdserve.transfer.thread.netdev import (
    UCX_CUDA_IPC_GET,
    advertised_address,
    enable_cuda_ipc_get,
    interface_addresses,
    interface_of,
    ucx_net_devices,
)


def test_net_devices_choice() -> None:
    assert interface_of("127.0.0.1") == "lo" and interface_of("localhost") == "lo"
    assert interface_of("203.0.113.77") is None  # (TEST-NET-3: held by no interface here)
    assert ucx_net_devices("127.0.0.1", None, {}) == "lo"
    assert ucx_net_devices("127.0.0.1", "mlx5_0:1", {}) == "mlx5_0:1"  # --kv-net-devices wins
    assert ucx_net_devices("127.0.0.1", None, {"UCX_NET_DEVICES": "eth0"}) is None  # the operator's own
    assert ucx_net_devices("0.0.0.0", None, {}) is None  # wildcard: left alone (with a warning)


def test_cuda_ipc_get_enabled_unless_the_operator_chose() -> None:
    # UCX's "auto" turns cuda_ipc GET off without NVLink: pull's READ then ran emulated over TCP (netdev.py)
    env: dict[str, str] = {}
    assert enable_cuda_ipc_get(env) and env == {UCX_CUDA_IPC_GET: "y"}
    env = {UCX_CUDA_IPC_GET: "n"}
    assert not enable_cuda_ipc_get(env) and env == {UCX_CUDA_IPC_GET: "n"}  # the operator's own, kept


def test_advertised_address() -> None:
    assert advertised_address("10.1.2.3") == "10.1.2.3"  # a given address is what peers dial, as given
    # a wildcard: an address of this host, never loopback where another exists (test_netns.py: in a namespace
    # whose host name resolves to 127.0.0.1 and that has no default route)
    local = [addr for _, addr in interface_addresses()]
    others = [addr for addr in local if not addr.startswith("127.")]
    assert advertised_address("0.0.0.0") in (others or ["127.0.0.1"])


def tcp_listeners(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_ucx_listens_on_loopback_only() -> None:
    # Seen on this CPU machine (lo + eth0): UCX's TCP transport opens one listener per allowed interface;
    # unrestricted ("all") it listened on 127.0.0.1 and on eth0's address as well.
    p = Instance("prefill", "pull").wait_ready()
    try:
        time.sleep(0.5)
        listeners = tcp_listeners(p.proc.pid)
        assert listeners, "expected the side channel (and UCX) to listen"
        assert all(addr.startswith("127.0.0.1:") for addr in listeners), listeners
    finally:
        p.call("shutdown")
        p.proc.join(10)
