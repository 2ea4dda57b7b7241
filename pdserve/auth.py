"""The deployment secret and what it signs: who may name which KV, and who may talk on the side channel.

One secret per deployment (`--kv-auth-secret-file PATH` or `--kv-auth-secret VALUE` on every instance and on
the router; `pdserve sweep` and `pdserve demo` generate one). With it:
- **capabilities**: transfer coordinates in kv_transfer_params are issued, not trusted. P (pull) or the router
  (push) signs what they name (engine id, request or transfer id, blocks, tokens, a digest of the prompt
  tokens, an expiry) with HMAC-SHA256; an instance refuses params that are unsigned, altered, expired or
  already used, before it allocates or dials anything;
- **the side channel**: both ends prove they hold the secret (an HMAC over the other side's fresh nonce) before
  any peer information is sent.
Without a secret every instance accepts unsigned params and unauthenticated peers, and says so at startup; it
then listens and dials on loopback addresses only, unless the operator passes INSECURE_FLAG (is_loopback,
unauthenticated_listen_error; docs/deploy.md).

Pure Python (hmac, hashlib): the router imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

MAC_HEX_CHARS = 64  # HMAC-SHA256, hex
NONCE_BYTES = 16
DEFAULT_TTL_S = 600.0  # a capability is good for this long after it was issued
MAX_CLOCK_SKEW_S = 60.0  # side-channel hellos older or newer than this are refused
INSECURE_FLAG = "--insecure-no-kv-auth"  # serve and proxy: run without a deployment secret beyond loopback


class AuthError(ValueError):
    """A capability or a peer failed authentication (the message says which check, never the secret)."""


def new_secret() -> str:
    """A fresh deployment secret (what `pdserve sweep` / `demo` hand to every process they start)."""
    return secrets.token_hex(32)


def load_secret(value: str | None, file: str | None) -> bytes | None:
    """The secret from a flag value or a file (first line, stripped); None when neither is given."""
    if value and file:
        raise ValueError("give the KV auth secret once: either a value or a file")
    if file:
        text = Path(file).read_text().strip()
        if not text:
            raise ValueError(f"KV auth secret file {file} is empty")
        return text.encode()
    if value:
        return value.encode()
    return None


class TokenIds(Protocol):
    """A prompt's token ids as a capability check reads them: a list, a tuple, or a numpy int64 array (an
    instance's unpacked prompt, prompt_pack.TokenArray; this module imports no numpy)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...


def prompt_digest(token_ids: TokenIds) -> str:
    """A collision-resistant digest of a token sequence (binds a capability to the tokens whose KV it names):
    blake2b over the ids as little-endian int64 (16k ids: ~0.8 ms; as JSON text it was ~5 ms, on P's engine
    thread and again on D's event loop, both on the first token's path). Raises ValueError for an id outside
    int64 (D digests a client's ids before the engine checks them against the vocabulary).
    Ids that already are contiguous int64 in memory (the numpy array of the router's packed ids, prompt_pack.py)
    are hashed from their buffer as they are, with the same digest: no packing."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"pdserve-prompt-q\0")
    buffer = _int64_buffer(token_ids)
    if buffer is not None:
        h.update(buffer)
        return h.hexdigest()
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error:
        raise ValueError("a token id is outside int64") from None
    return h.hexdigest()


def _int64_buffer(token_ids: Any) -> memoryview | None:
    """token_ids' memory when it is a C-contiguous buffer of little-endian 8-byte signed integers, else None (a list,
    a tuple: packed by prompt_digest). Duck-typed through the buffer protocol: this module imports no numpy."""
    if isinstance(token_ids, list | tuple) or sys.byteorder != "little":
        return None
    try:
        view = memoryview(token_ids)
    except TypeError:
        return None
    if view.format in ("q", "l", "<q", "<l") and view.itemsize == 8 and view.c_contiguous and view.ndim == 1:
        return view
    return None


def _canonical(purpose: str, fields: Sequence[object]) -> bytes:
    return json.dumps([purpose, *fields], separators=(",", ":"), sort_keys=True).encode()


class Signer:
    """HMAC-SHA256 over (purpose, fields) with the deployment secret. Purposes keep signatures of one kind
    from being accepted as another ("pull", "push", "side-channel-client", ...)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the KV auth secret must be at least 16 bytes")
        self._key = secret

    def sign(self, purpose: str, fields: Sequence[object]) -> str:
        return hmac.new(self._key, _canonical(purpose, fields), hashlib.sha256).hexdigest()

    def verify(self, purpose: str, fields: Sequence[object], mac: str) -> bool:
        return hmac.compare_digest(self.sign(purpose, fields), mac)


class ReplayGuard:
    """Remembers MACs (or nonces) until their expiry so each is accepted once. Bounded: past `max_entries` the
    oldest are dropped (they are also the first to expire). Single-threaded use per instance."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()  # key -> expiry (time.time())
        self._max = max_entries

    def first_use(self, key: str, expires_at: float, now: float | None = None) -> bool:
        """True the first time `key` is presented (and records it); False on a replay."""
        now = time.time() if now is None else now
        while self._seen:
            oldest, exp = next(iter(self._seen.items()))
            if exp > now and len(self._seen) < self._max:
                break
            self._seen.popitem(last=False)
        if key in self._seen:
            return False
        self._seen[key] = expires_at
        return True

    def __contains__(self, key: str) -> bool:
        """Whether `key` was presented before (and not forgotten); records nothing."""
        return key in self._seen


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()


def is_loopback(host: str) -> bool:
    """host is a loopback address (127.0.0.0/8, ::1) or "localhost"; a wildcard or any other name is not (a name
    is never resolved here: it could resolve anywhere later)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unauthenticated_listen_error(addresses: dict[str, str]) -> str | None:
    """Why a process without a deployment secret must not listen on these addresses ({flag: address}), or None
    when every one is a loopback address."""
    exposed = [f"{flag} {address}" for flag, address in addresses.items() if not is_loopback(address)]
    if not exposed:
        return None
    return (
        f"{' and '.join(exposed)} is not a loopback address and there is no deployment secret: anyone who reaches "
        "it could read other requests' KV, poison the prefix cache or make this deployment dial out. Give every "
        "instance and the router the same --kv-auth-secret-file, or pass " + INSECURE_FLAG + " to run "
        "unauthenticated beyond loopback anyway (docs/deploy.md)"
    )
