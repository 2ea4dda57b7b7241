"""Who may call which HTTP route: the client key and the deployment's internal credential (two roles).

Both are bearer tokens (`Authorization: Bearer KEY`), both optional, on instances and on the router:
- the **client key** (`--api-key`): the OpenAI API (`/v1/*`) and `/metrics` (unless `metrics_internal`);
- the **internal credential** (`--internal-api-key` / `--internal-api-key-file`): the routes the deployment
  itself calls, which a client never needs: `/kv_transfer/*` (P's side-channel coordinates; freeing another
  request's pinned KV), `/timeline` (every request's ids and timings) and `/kv_events` (which prompt prefixes
  the instance holds: what other users sent), and `/metrics` with `metrics_internal`. The router holds it and
  sends it to the instances instead of the client key; it opens the client routes too (the router calls them).

What a route accepts (`route_role` names the role of a path; every path not listed below is internal):

| role | internal credential set | only the client key set | neither |
|---|---|---|---|
| open (`/health`) | anyone | anyone | anyone |
| client (`/v1/*`, `/metrics`) | client or internal key (anyone without a client key) | the client key | anyone |
| internal (`/kv_transfer/*`, `/timeline`, `/kv_events`) | the internal credential only | the client key | anyone |

With only the client key set, it opens every route (one key for all, as before roles); so once an internal
credential is set the client key no longer opens an internal route. `web.RoleAuth` applies
the table and marks a request that presented the internal credential (`web.is_internal_caller`):
`POST /kv_transfer/release` then needs no capability (server/routes.py).

The standard library only: every subcommand's parser imports it.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path

OPEN_PATHS = ("/health",)  # answered without a key (load balancers and orchestrators poll it)
CLIENT_PREFIX = "/v1/"  # the OpenAI API
METRICS_PATH = "/metrics"
INTERNAL_CALLER = "pdserve_internal_caller"  # key in the ASGI scope's state: the internal credential was shown


class RouteRole(enum.Enum):
    OPEN = "open"
    CLIENT = "client"
    INTERNAL = "internal"


def load_key(value: str | None, file: str | None, flag: str) -> str | None:
    """A key from a flag value or a file (its first line, stripped); None when neither is given."""
    if value is not None and file is not None:
        raise ValueError(f"give {flag} once: either a value or {flag}-file")
    if file is not None:
        lines = Path(file).read_text().strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"{flag}-file {file} is empty")
        return lines[0].strip()
    if value is not None and not value.strip():
        raise ValueError(f"{flag} is empty: an empty key protects nothing")
    return value


@dataclass(frozen=True)
class Credentials:
    """The keys one HTTP server checks (instances and router alike)."""

    client_key: str | None = field(default=None, repr=False)  # --api-key: /v1/*, /metrics
    internal_key: str | None = field(default=None, repr=False)  # --internal-api-key: every internal route
    metrics_internal: bool = False  # /metrics needs the internal credential instead of the client key

    def __post_init__(self) -> None:
        for name, key in (("API key", self.client_key), ("internal API key", self.internal_key)):
            if key is not None and not key:
                raise ValueError(f"an empty {name} protects nothing")
        if self.client_key is not None and self.client_key == self.internal_key:
            raise ValueError(
                "the internal API key must differ from the client --api-key (a client would hold both roles)"
            )
        if self.metrics_internal and self.internal_key is None:
            raise ValueError("--internal-metrics needs --internal-api-key (or --internal-api-key-file)")

    @property
    def is_enabled(self) -> bool:
        return self.client_key is not None or self.internal_key is not None

    @property
    def upstream_key(self) -> str | None:
        """The key a router sends to its instances: the internal credential when it holds one."""
        return self.internal_key if self.internal_key is not None else self.client_key

    def route_role(self, path: str) -> RouteRole:
        if path in OPEN_PATHS:
            return RouteRole.OPEN
        if path.startswith(CLIENT_PREFIX) or (path == METRICS_PATH and not self.metrics_internal):
            return RouteRole.CLIENT
        return RouteRole.INTERNAL


def add_internal_key_arguments(group: argparse._ArgumentGroup | argparse.ArgumentParser, is_router: bool) -> None:
    """--internal-api-key, --internal-api-key-file (and, on an instance, --internal-metrics)."""
    who = (
        "the router sends it to the instances instead of --api-key (start them with the same one)"
        if is_router
        else "/kv_transfer/*, /timeline and /kv_events then accept only it, no longer --api-key; the router holds it"
    )
    group.add_argument(
        "--internal-api-key",
        default=None,
        metavar="KEY",
        help=f"the deployment's internal credential, for the routes only the deployment calls: {who}. "
        "Prefer --internal-api-key-file (a flag value shows in ps). Default: none (internal routes take --api-key)",
    )
    group.add_argument(
        "--internal-api-key-file", default=None, metavar="PATH", help="read --internal-api-key from this file"
    )
    if not is_router:
        group.add_argument(
            "--internal-metrics",
            action="store_true",
            help="/metrics needs --internal-api-key instead of --api-key (default: the client key opens it)",
        )


def credentials_from(args: argparse.Namespace) -> Credentials:
    """Credentials from --api-key and the flags of add_internal_key_arguments; raises ValueError naming the flag."""
    internal = load_key(args.internal_api_key, args.internal_api_key_file, "--internal-api-key")
    client = load_key(args.api_key, None, "--api-key")
    return Credentials(client, internal, getattr(args, "internal_metrics", False))
