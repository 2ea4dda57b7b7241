"""Where NIXL's data plane (UCX) may listen: the operator's choice, else the side channel's interface.

UCX opens its own listeners (the TCP transport listens on every interface it is allowed to use) and reads
its configuration from the environment when the NIXL agent creates its UCX context. So before the agent
exists, `ucx_net_devices` picks the value of UCX_NET_DEVICES:
  1. `--kv-net-devices` (TransferConfig.net_devices), as given ("mlx5_0:1", "eth0", "lo,eth1");
  2. else the operator's own UCX_NET_DEVICES, untouched;
  3. else the interface holding the side-channel host: 127.0.0.1 -> "lo", another address -> the interface
     that has it (found with socket.if_nameindex and the SIOCGIFADDR ioctl); a wildcard host ("0.0.0.0"), an
     IPv6 or an unresolvable one leaves UCX alone (and says so).
RDMA/EFA devices are not IP interfaces: name them with --kv-net-devices (docs/deploy.md).
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


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 `address` (a loopback address -> "lo"); None if none."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    if ip.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # the interface has no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == str(ip):
                return name
    return None


def ucx_net_devices(side_channel_host: str, override: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The UCX_NET_DEVICES value to set before the agent is created; None: leave the environment as it is."""
    env = os.environ if environ is None else environ
    if override:
        return override
    if env.get(UCX_NET_DEVICES):
        return None
    if side_channel_host in ("", "0.0.0.0", "::"):
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
