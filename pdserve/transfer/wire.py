"""Wire messages of the transfer layer: side-channel frames and NIXL notifications (msgpack; never pickle).

Every message is a msgpack map {"type": <name>, "v": WIRE_VERSION, <fields>}; encode() and decode() are the
only ways in and out, and decode() checks the version, the type and every field's type, raising WireError
on anything else (a malformed message from a peer must never crash the transfer thread). The side channel's
frames are defined here; the NIXL notifications (pull's release, push's registration and completions) are
wire_notifs.py's, under the same version; whether two handshakes' PeerInfo can exchange KV is wire_compat.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

import msgpack

from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.groups import KVGroup, KVGroups
from pdserve.transfer.wire_notifs import (
    PullRelease,
    PullReleaseAck,
    PushCancel,
    PushCancelAck,
    PushDone,
    PushFail,
    PushQueued,
    PushRegister,
)

# 1: first version — handshake, ping, pull release, push register/done/cancel/cancel-ack/fail (2026-11-30).
# 2: PushRegister.keepalive_ms and PushQueued: P says a registered prefill is queued or running (2026-11-30).
# 3: the KV cache is block-major [blocks, layers, 2, block_size, heads, head_dim] (addresses differ) (2026-12-01).
# 4: Sealed (a side-channel frame with an HMAC over a nonce, a timestamp and the message) and Refused (2026-12-02).
# 5: PullRelease.block_ids and PullReleaseAck (D runs a pull only once P confirms the pin held); PeerInfo.epoch
#    and Pong.epoch (a restarted peer is recognised) (2026-12-02).
# 6: tensor parallelism: PeerInfo.total_kv_heads and .rank_ports (every rank's side channel); the compatibility
#    hash covers the model's KV heads, not a rank's; D registers with / releases to every P rank (2026-12-03).
# 7: sliding-window models: PeerInfo.group_windows / .group_layers (the KV layer groups, in the compatibility
#    hash) and PushRegister.block_tables (D's table per group) (2026-12-04).
# 8: heads before tokens inside a block, [blocks, layers, 2, heads, block_size, head_dim] (addresses differ; a
#    partial last block is sent whole) (2026-12-01).
# 9: --kv-checksum: PeerInfo.kv_checksum (in the compatibility hash), PushDone.checksum, PullRelease.checksum_heads
#    / .checksum_ranges and PullReleaseAck.checksum (transfer/checksum.py) (2026-12-03).
# 10: PeerInfo.geometry, the KV cache's geometry as one map (kv/geometry.py; elem_size in place of token_bytes),
#     in place of its flat num_layers, num_kv_heads, total_kv_heads, head_dim, num_blocks, block_size,
#     token_bytes, group_windows and group_layers (2026-12-03).
# 11: PullReleaseAck.refused: P holds no KV under the release's coordinates (never pinned here, or released by
#     every consumer rank already): D answers its client 400, not 500 (2026-12-03).
# 12: PushDone.first_token_id: P hands D its first output token with the KV of the whole prompt; D registers
#     tokens [prefix hit, n) instead of [prefix hit, n - 1) (2026-12-03).
WIRE_VERSION = 12
MAX_MESSAGE_BYTES = 16 << 20  # side-channel frames and notifications larger than this are refused


class WireError(ValueError):
    """A message could not be decoded (bad bytes, unknown type, wrong version, wrong field types)."""


@dataclass(frozen=True)
class PeerInfo:
    """One instance's handshake payload: who it is, where its KV cache is, and what it is compatible with."""

    engine_id: str
    agent_name: str  # NIXL agent name (unique per process)
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    model_name: str
    dtype: str
    transfer_mode: str  # "pull" | "push"
    wire_version: int
    geometry: CacheGeometry  # the KV cache's (this rank's heads, the model's, KV groups); encoded as one map
    base_addr: int  # KV cache address in the owner's process
    device_id: int
    memory: str  # "DRAM" | "VRAM"
    tp_rank: int
    tp_size: int
    rank_ports: list[int]  # side-channel port of every rank, on this host (rank 0's handshake lists them all)
    compat_hash: str
    epoch: int  # this process's start (time.time_ns()): a restarted peer at the same address has another
    kv_checksum: bool = False  # --kv-checksum: every transfer's KV is summed on both sides (transfer/checksum.py)

    @property
    def is_windowed(self) -> bool:
        return self.geometry.groups.is_windowed


def encode_geometry(g: CacheGeometry) -> dict[str, Any]:
    """The geometry's wire map: its sizes, and per KV group its window (0 = the whole context) and layers."""
    return {
        "num_blocks": g.num_blocks, "block_size": g.block_size, "num_kv_heads": g.num_kv_heads,
        "total_kv_heads": g.total_kv_heads, "head_dim": g.head_dim, "elem_size": g.elem_size,
        "group_windows": [w or 0 for w in g.windows], "group_layers": [list(grp.layers) for grp in g.groups.groups],
    }  # fmt: skip


def decode_geometry(v: Any) -> CacheGeometry:
    """encode_geometry's inverse; WireError on a missing or mistyped field or groups of unequal sizes."""
    if not isinstance(v, dict):
        raise WireError("PeerInfo.geometry: expected a map")
    sizes = ("num_blocks", "block_size", "num_kv_heads", "total_kv_heads", "head_dim", "elem_size")
    for name in sizes:
        if type(v.get(name)) is not int:
            raise WireError(f"PeerInfo.geometry.{name}: expected int, got {type(v.get(name)).__name__}")
    windows = _check(PeerInfo, "geometry.group_windows", v.get("group_windows"), list[int])
    layers = _check(PeerInfo, "geometry.group_layers", v.get("group_layers"), list[list[int]])
    if len(windows) != len(layers) or not layers or len({len(t) for t in layers}) != 1:
        raise WireError("PeerInfo.geometry: bad KV groups (one or more, one window each, equal layer counts)")
    groups = KVGroups(tuple(KVGroup(w or None, tuple(t)) for w, t in zip(windows, layers, strict=True)), len(layers[0]))
    try:
        return CacheGeometry(v["num_blocks"], v["block_size"], v["num_kv_heads"], v["total_kv_heads"], v["head_dim"],
                             v["elem_size"], groups)  # fmt: skip
    except ValueError as e:
        raise WireError(f"PeerInfo.geometry: {e}") from None


@dataclass(frozen=True)
class HandshakeRequest:
    """Side channel, consumer -> producer: here is who I am; tell me who you are."""

    peer: PeerInfo
    load_me: bool  # push: the producer must load this agent to WRITE into it and answer it


@dataclass(frozen=True)
class HandshakeReply:
    ok: bool
    peer: PeerInfo | None  # the producer's info (also on refusal, so the consumer can word the error)
    error: str  # why the handshake was refused when not ok


@dataclass(frozen=True)
class Ping:
    """Side channel liveness probe (a consumer asking whether a producer's agent still exists)."""


@dataclass(frozen=True)
class Pong:
    engine_id: str
    agent_name: str
    epoch: int  # PeerInfo.epoch of the answering process


@dataclass(frozen=True)
class Sealed:
    """Side channel with a deployment secret (handshake.py): one message wrapped with proof of the secret.
    Request: mac = HMAC("side-channel-client", [nonce, ts_ms, sha256(body)]), nonce fresh per request.
    Reply: mac = HMAC("side-channel-server", [the request's nonce, ts_ms, sha256(body)])."""

    nonce: str  # the client's fresh nonce (hex), echoed in the reply
    ts_ms: int  # sender's wall clock, ms since the epoch (requests off by more than MAX_CLOCK_SKEW_S are refused)
    mac: str  # HMAC-SHA256 hex
    body: bytes  # one encoded message (never a Sealed)


@dataclass(frozen=True)
class Refused:
    """Side channel: the request was not authenticated (or the ends disagree on having a secret). Says only
    why, never anything about this instance."""

    reason: str


Message = (
    HandshakeRequest
    | HandshakeReply
    | Ping
    | Pong
    | PullRelease
    | PullReleaseAck
    | PushRegister
    | PushDone
    | PushCancel
    | PushCancelAck
    | PushFail
    | PushQueued
    | Sealed
    | Refused
)
_TYPES: dict[str, type] = {
    c.__name__: c
    for c in (
        HandshakeRequest,
        HandshakeReply,
        Ping,
        Pong,
        PullRelease,
        PullReleaseAck,
        PushRegister,
        PushDone,
        PushCancel,
        PushCancelAck,
        PushFail,
        PushQueued,
        Sealed,
        Refused,
    )
}


_HINTS: dict[type, dict[str, Any]] = {}  # field types per message class, filled lazily (get_type_hints is slow)


def _to_plain(msg: Any) -> dict[str, Any]:
    return {f.name: _plain_value(getattr(msg, f.name)) for f in dataclasses.fields(msg)}


def _plain_value(v: Any) -> Any:
    if isinstance(v, CacheGeometry):
        return encode_geometry(v)
    return _to_plain(v) if dataclasses.is_dataclass(v) else v


def encode(msg: Message) -> bytes:
    return msgpack.packb({"type": type(msg).__name__, "v": WIRE_VERSION, **_to_plain(msg)}, use_bin_type=True)


def _check(cls: type, name: str, v: Any, hint: Any) -> Any:
    if hint in (int, str, bytes, bool):
        if type(v) is not hint:  # noqa: E721 (bool is not an int here)
            raise WireError(f"{cls.__name__}.{name}: expected {hint.__name__}, got {type(v).__name__}")
        return v
    if hint == list[int]:
        if not isinstance(v, list) or any(type(x) is not int for x in v):
            raise WireError(f"{cls.__name__}.{name}: expected a list of int")
        return v
    if hint == list[list[int]]:
        if not isinstance(v, list) or any(not isinstance(t, list) or any(type(x) is not int for x in t) for t in v):
            raise WireError(f"{cls.__name__}.{name}: expected a list of lists of int")
        return v
    if hint == CacheGeometry:
        return decode_geometry(v)
    if hint == PeerInfo or hint == PeerInfo | None:
        if v is None and hint != PeerInfo:
            return None
        if not isinstance(v, dict):
            raise WireError(f"{cls.__name__}.{name}: expected a map")
        return _build(PeerInfo, v)
    raise WireError(f"{cls.__name__}.{name}: unsupported field type {hint}")  # a bug in this file


def _build(cls: type, fields: dict[str, Any]) -> Any:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    missing = [n for n in hints if n not in fields]
    if missing:
        raise WireError(f"{cls.__name__}: missing fields {missing}")
    return cls(**{n: _check(cls, n, fields[n], h) for n, h in hints.items()})


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes is larger than {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not msgpack: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("message is not a map")
    if obj.get("v") != WIRE_VERSION:
        raise WireError(f"wire version {obj.get('v')!r}, this instance speaks {WIRE_VERSION}")
    kind = obj.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message type {obj.get('type')!r}")
    return _build(cls, obj)
