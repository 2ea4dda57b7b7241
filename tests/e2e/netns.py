"""Linux network namespaces as separate "hosts" for end-to-end tests: one /24 on a bridge, no loopback path.

    net = Netns.create(["p", "d", "router"])   # raises NetnsUnavailable (a skip reason) where not allowed
    net.hosts["p"].address                     # "10.77.N.1": the namespace's only non-loopback address
    net.exec_prefix("p")                       # ("ip", "netns", "exec", "pdserve-<tag>-p"): run a command there
    net.close()                                # deletes the namespaces and the root namespace's veth end

Topology: a switch namespace holds a bridge; each host namespace has one veth whose peer is a port of that
bridge; the root namespace gets one more veth into the bridge with address .254, so the test process reaches
every host directly (no forwarding, no routes to add). Each host namespace has `lo` up, as every real host
does: NIXL's UCX backend connects to its own TCP listener at startup (seen here: with `lo` down that connect
hangs in SYN-SENT and the instance never becomes ready, docs/deploy.md). A random tag names everything
(namespaces, interfaces: <= 15 characters), and the /24 is one the root namespace does not route yet, so
parallel runs do not collide.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass

SUBNET_PREFIX = "10.77"  # the hosts live in 10.77.N.0/24, N free in the root namespace's routes
ROOT_HOST_OCTET = 254  # the root namespace's address in the subnet


class NetnsUnavailable(RuntimeError):
    """This machine does not let the test build namespaces (the message is the skip reason)."""


@dataclass(frozen=True)
class Host:
    """One namespace standing in for a host."""

    netns: str  # namespace name (ip netns)
    interface: str  # its veth (the only non-loopback interface)
    address: str  # the veth's IPv4 address


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> str:
    """10.77.N for an N that no route of the root namespace covers yet."""
    used = _ip("-4", "route", "show", "table", "all")
    free = [n for n in range(1, 254) if f"{SUBNET_PREFIX}.{n}." not in used]
    if not free:
        raise NetnsUnavailable(f"every {SUBNET_PREFIX}.N.0/24 is routed already")
    return f"{SUBNET_PREFIX}.{random.choice(free)}"


class Netns:
    """Host namespaces on one bridge, reachable from the root namespace; `close()` removes all of it."""

    def __init__(self, tag: str, subnet: str) -> None:
        self.tag = tag  # 6 hex characters in every name
        self.subnet = subnet  # "10.77.N"
        self.switch = f"pdserve-{tag}-sw"
        self.root_interface = f"pd{tag}c"
        self.root_address = f"{subnet}.{ROOT_HOST_OCTET}"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []

    @classmethod
    def create(cls, names: list[str]) -> Netns:
        """Namespaces named `names` (short: one letter goes into interface names) on a fresh subnet.
        Raises NetnsUnavailable when this machine cannot (not Linux, not root, no `ip`, `ip netns add` fails)."""
        if not sys.platform.startswith("linux"):
            raise NetnsUnavailable("network namespaces are a Linux feature")
        if os.geteuid() != 0:
            raise NetnsUnavailable("creating network namespaces needs root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("needs `ip` (iproute2)")
        if len({name[0] for name in names} | {"c"}) != len(names) + 1:
            raise ValueError(f"host names need distinct first letters other than 'c' (the root's): {names}")
        net = cls(secrets.token_hex(3), _free_subnet())
        try:
            net._add_namespace(net.switch)
            _ip("netns", "exec", net.switch, "true")  # needs to mount /sys there, which some containers refuse
        except RuntimeError as e:
            net.close()
            raise NetnsUnavailable(f"`ip netns add` or `ip netns exec` failed: {e}") from None
        try:
            _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", net.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names, start=1):
                net._add_host(name, f"{net.subnet}.{i}")
            net._add_root_port()
        except RuntimeError as e:
            net.close()
            raise NetnsUnavailable(f"cannot build the veth/bridge topology: {e}") from None
        return net

    def _add_namespace(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._namespaces.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")

    def _bridge_port(self, interface: str, netns: str | None) -> None:
        """A veth pair: `interface` (moved into `netns` unless None) and its peer, a port of the bridge."""
        port = interface + "b"
        _ip("link", "add", interface, "type", "veth", "peer", "name", port)
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        if netns is not None:
            _ip("link", "set", interface, "netns", netns)

    def _add_host(self, name: str, address: str) -> None:
        netns, interface = f"pdserve-{self.tag}-{name}", f"pd{self.tag}{name[0]}"
        self._add_namespace(netns)
        self._bridge_port(interface, netns)
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", interface)
        _ip("-n", netns, "link", "set", interface, "up")
        self.hosts[name] = Host(netns, interface, address)

    def _add_root_port(self) -> None:
        self._bridge_port(self.root_interface, None)
        _ip("addr", "add", f"{self.root_address}/24", "dev", self.root_interface)
        _ip("link", "set", self.root_interface, "up")

    def exec_prefix(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a program in host `name`'s namespace."""
        return ("ip", "netns", "exec", self.hosts[name].netns)

    def rx_bytes(self, name: str) -> int:
        """Bytes host `name` has received on its veth so far (every byte from another host arrives there)."""
        host = self.hosts[name]
        stats = json.loads(_ip("-n", host.netns, "-s", "-j", "link", "show", "dev", host.interface))
        return int(stats[0]["stats64"]["rx"]["bytes"])

    def tcp_listeners(self, name: str) -> list[str]:
        """ "address:port" of every listening TCP socket in host `name`'s namespace."""
        out = subprocess.run([*self.exec_prefix(name), "ss", "-ltnH"], capture_output=True, text=True, check=True)
        return [line.split()[3] for line in out.stdout.splitlines()]

    def close(self) -> None:
        """Delete the root namespace's veth and every namespace (their veths go with them); never raises."""
        subprocess.run(["ip", "link", "del", self.root_interface], capture_output=True)
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._namespaces.clear()
