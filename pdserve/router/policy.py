"""Choosing an instance for a leg: least outstanding requests (default), round robin, or KV-aware (least
cost, where the caller's cost weighs what the instance has cached against its load: router/kv_route.py).

The router counts its own outstanding legs per backend; it does not poll the instances' metrics, so the
count is exact for traffic through this router and blind to traffic that bypasses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

POLICIES = ("least-loaded", "round-robin", "kv-aware")
MODES = ("pull", "push", "colocated")  # pull/push: a prefill and a decode leg; colocated: whole requests


@dataclass
class Backend:
    url: str  # base URL, no trailing slash: http://127.0.0.1:8100
    num_outstanding: int = 0  # legs sent to it and not answered yet (streams count until they end)
    healthy: bool = True  # its last /health check answered 200 (router/health.py); until the first, assumed
    epoch: str | None = None  # the process epoch its /health reports: a new one means it restarted
    packed_ids: int | None = None  # the packed-prompt version its /health says it reads (prompt_pack.py); None: JSON


class Pool:
    """The instances of one role (prefill or decode) and the policy that picks among them.

    Single-threaded: used from the router's event loop only.
    """

    def __init__(self, role: str, urls: list[str], policy: str = "least-loaded") -> None:
        if not urls:
            raise ValueError(f"no {role} instance given")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.role = role  # "prefill" | "decode" | "instance" (colocated), named in errors
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self.policy = policy
        self._cycle = itertools.cycle(range(len(self.backends)))
        self._next_tie = itertools.count()  # rotates ties among equally loaded backends

    def has_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def choose(self, cost: Callable[[Backend], float] | None = None) -> Backend:
        """A backend by the policy, among the healthy ones (all of them when none is healthy: the leg then
        fails with the backend's own error rather than the router guessing). kv-aware: the least `cost`
        (ties rotate); without a cost (a prompt the router cannot hash) it is least-loaded."""
        candidates = [b for b in self.backends if b.healthy] or self.backends
        if self.policy == "kv-aware" and cost is not None:
            costs = [cost(b) for b in candidates]
            cheapest = min(costs)
            tied = [b for b, c in zip(candidates, costs, strict=True) if c == cheapest]
            return tied[next(self._next_tie) % len(tied)]
        if self.policy == "round-robin":
            for _ in range(len(self.backends)):
                b = self.backends[next(self._cycle)]
                if b in candidates:
                    return b
            return candidates[0]
        least = min(b.num_outstanding for b in candidates)
        tied = [b for b in candidates if b.num_outstanding == least]
        return tied[next(self._next_tie) % len(tied)]

    def lease(self, backend: Backend) -> Lease:
        """Count one outstanding leg on `backend` until the lease is released."""
        return Lease(backend)


class Lease:
    """One outstanding leg on a backend; `release()` is idempotent, and `with` releases at the end."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._released = False
        backend.num_outstanding += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.num_outstanding -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
