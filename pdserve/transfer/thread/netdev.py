"""Where NIXL's data plane (UCX) may listen: the operator's choice, else the side channel's interface; and
that UCX may READ from another process's GPU memory directly (cuda_ipc GET, `enable_cuda_ipc_get`).

UCX opens its own listeners (the TCP transport listens on every interface it is allowed to use) and reads
its configuration from the environment when the NIXL agent creates its UCX context. So before the agent
exists, `ucx_net_devices` picks the value of UCX_NET_DEVICES:
  1. `--kv-net-devices` (TransferConfig.net_devices), as given ("mlx5_0:1", "eth0", "lo,eth1");
  2. else the operator's own UCX_NET_DEVICES, untouched;
  3. else the interface holding the side channel's advertised address: 127.0.0.1 -> "lo", another address ->
     the interface that has it (found with socket.if_nameindex and the SIOCGIFADDR ioctl); an IPv6 or an
     unresolvable one leaves UCX alone (and says so).
RDMA/EFA devices are not IP interfaces: name them with --kv-net-devices (docs/deploy.md).

A wildcard side-channel host ("0.0.0.0") is not an address a peer can dial: `advertised_address` picks the one
this instance reports (in /kv_transfer/info, signed into push capabilities), and the worker passes that
address, not the wildcard, to rule 3: UCX listens where peers are told to dial. Hosts whose name resolves to a
loopback address (/etc/hosts "127.0.1.1 host" on Debian, "127.0.0.1 host" on the test machine) used to
advertise that loopback address, which a peer on another host or network namespace dials as its own; so a
loopback answer from the host name is passed over for the default route's source address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
UCX_NET_DEVICES = "UCX_NET_DEVICES"
UCX_CUDA_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


WILDCARD_HOSTS = ("", "0.0.0.0", "::")
ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1, discard port: a UDP connect() picks a route and sends nothing


def interface_addresses() -> list[tuple[str, str]]:
    """(interface name, IPv4 address) of every local interface that has one, in interface index order."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # the interface has no IPv4 address
                continue
            out.append((name, socket.inet_ntoa(packed[20:24])))
    return out


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 `address` (a loopback address -> "lo"); None if none."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    if ip.is_loopback:
        return "lo"
    return next((name for name, addr in interface_addresses() if addr == str(ip)), None)


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def advertised_address(host: str) -> str:
    """The IPv4 address peers should dial for a listener bound to `host`: `host` itself unless it is a
    wildcard; for a wildcard, the first non-loopback one of: the host name's address, the source address of
    the route to a non-local address (the default route's), the first interface's address; else 127.0.0.1
    (a host without a network: only local peers can reach it)."""
    if host not in WILDCARD_HOSTS:
        return host
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(ROUTE_PROBE)
            candidates.append(s.getsockname()[0])
    except OSError:  # no route off this host (no default route)
        pass
    candidates += [addr for _, addr in interface_addresses()]
    chosen = next((a for a in candidates if not _is_loopback(a)), "127.0.0.1")
    log.warning("side channel on the wildcard address %r: advertising %s to peers (set --kv-side-channel-host "
                "to the address peers should dial)", host, chosen)  # fmt: skip
    return chosen


def ucx_net_devices(side_channel_host: str, override: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The UCX_NET_DEVICES value to set before the agent is created; None: leave the environment as it is."""
    env = os.environ if environ is None else environ
    if override:
        return override
    if env.get(UCX_NET_DEVICES):
        return None
    if side_channel_host in WILDCARD_HOSTS:
        log.warning("side channel on a wildcard address: UCX listens on every interface (set --kv-net-devices)")
        return None
    name = interface_of(side_channel_host)
    if name is None:
        log.warning("no local IPv4 interface holds %s: UCX listens on every interface (set --kv-net-devices)",
                    side_channel_host)  # fmt: skip
    return name


def restrict_ucx(side_channel_host: str, override: str | None) -> None:
    """Set UCX_NET_DEVICES for this process (before the NIXL agent exists) as ucx_net_devices decides."""
    value = ucx_net_devices(side_channel_host, override)
    if value is not None:
        os.environ[UCX_NET_DEVICES] = value
        log.info("UCX data plane restricted to %s", value)


def enable_cuda_ipc_get(environ: dict[str, str] | None = None) -> bool:
    """Let UCX's cuda_ipc transport serve GETs (pull's READ) too, unless the operator set UCX_CUDA_IPC_ENABLE_GET_ZCOPY.
    True when this call set it. Call before the NIXL agent exists (UCX reads it when the agent is created).

    UCX's default ("auto") turns cuda_ipc GET off on a GPU without active NVLinks (concurrent reads were slower
    than puts over PCIe in its all-to-all benchmarks). cuda_ipc PUT (push's WRITE) stays on, but a READ then
    falls back to UCX's *software-emulated* GET over TCP (UCX_PROTO_INFO=y: "remote memory read by ucp_get* into
    cuda ... software emulation | tcp/lo"): P's worker answers the GET with active messages from its own polling,
    ~0.5 GB/s, READs from one P share that one ordered stream (each waits for those posted before it) and P's
    PullReleaseAck queues behind every READ in flight. Seen on one H200 without NVLink (P and D on GPU 0): a
    1.4 GB Gemma-3 READ took 2.5-3 s and acks came seconds late (docs/architecture.md, pull step 5)."""
    env = os.environ if environ is None else environ
    if env.get(UCX_CUDA_IPC_GET):
        return False
    env[UCX_CUDA_IPC_GET] = "y"
    return True
