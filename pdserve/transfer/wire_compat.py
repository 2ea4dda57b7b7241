"""Whether two instances can exchange KV: the compatibility hash in every handshake and the refusal that names
both sides' values.

Two instances agree on COMPAT_FIELDS (model, dtype, layers, the model's KV heads, head size, mode, wire
version, KV groups, --kv-checksum) or their KV cannot move between them; their tensor-parallel sizes must also
map (heads.py). Block sizes may differ (layout.group_ranges translates). Kept apart from wire.py's codec: this
is a policy over PeerInfo, checked once per handshake on both sides (thread/worker.py, thread/peers.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from pdserve.transfer.heads import mapping_error
from pdserve.transfer.wire import PeerInfo, encode_geometry

COMPAT_FIELDS = (
    "model_name", "dtype", "num_layers", "total_kv_heads", "head_dim", "transfer_mode", "wire_version",
    "group_windows", "group_layers", "kv_checksum",
)  # fmt: skip
COMPAT_DEFAULTS = {"kv_checksum": False}  # fields a caller of compat_hash may leave out (PeerInfo's defaults)


def compat_values(info: PeerInfo) -> dict[str, Any]:
    """COMPAT_FIELDS of a handshake (the cache's from its geometry: num_layers = layers per block)."""
    g = encode_geometry(info.geometry)  # its group lists as the wire writes them
    return {
        "model_name": info.model_name, "dtype": info.dtype, "num_layers": info.geometry.layers_per_block,
        "total_kv_heads": g["total_kv_heads"], "head_dim": g["head_dim"], "transfer_mode": info.transfer_mode,
        "wire_version": info.wire_version, "group_windows": g["group_windows"], "group_layers": g["group_layers"],
        "kv_checksum": info.kv_checksum,
    }  # fmt: skip


def compat_hash(values: dict[str, Any]) -> str:
    """Hash over the fields two instances must agree on (COMPAT_FIELDS)."""
    values = {**COMPAT_DEFAULTS, **values}
    packed = msgpack.packb([[k, values[k]] for k in COMPAT_FIELDS], use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:16]


def incompatibility(local: PeerInfo, peer: PeerInfo, local_is_producer: bool = False) -> str | None:
    """None if the two can exchange KV, else an error naming both sides' values (for tensor-parallel sizes that
    cannot map, both sides' TP sizes and KV head counts, as heads.mapping_error words it)."""
    ours, peers = compat_values(local), compat_values(peer)
    if local.compat_hash == peer.compat_hash == compat_hash(peers):
        return _mapping(local, peer, local_is_producer)  # any pair of block sizes (layout.group_ranges)
    diffs = []
    for name in COMPAT_FIELDS:
        mine, theirs = ours[name], peers[name]
        if mine == theirs:
            continue
        if name == "transfer_mode":
            diffs.append(f"peer is in {theirs} mode, this instance is in {mine} mode")
        elif name == "kv_checksum":  # both ends must sum, or a transfer would go unchecked (or fail)
            on = {True: "on", False: "off"}
            diffs.append(f"--kv-checksum is {on[theirs]} on the peer, {on[mine]} on this instance")
        elif name in ("group_windows", "group_layers"):
            words = f"KV groups: peer has {_groups(peer)}, this instance has {_groups(local)}"
            diffs += [words] if words not in diffs else []
        else:
            diffs.append(f"{name}: peer has {theirs!r}, this instance has {mine!r}")
    if not diffs:
        diffs.append(f"compatibility hash: peer sent {peer.compat_hash}, this instance has {local.compat_hash}")
    return f"incompatible with peer engine {peer.engine_id!r}: " + "; ".join(diffs)


def _groups(info: PeerInfo) -> str:
    """The KV group structure in words: window (or full) and layers per group."""
    parts = [
        f"{f'window {g.window}' if g.window else 'full'} layers {list(g.layers)}" for g in info.geometry.groups.groups
    ]
    return "[" + ", ".join(parts) + "]"


def _mapping(local: PeerInfo, peer: PeerInfo, local_is_producer: bool) -> str | None:
    """Whether the two instances' tensor-parallel sizes map (the model's heads are equal: the hash matched)."""
    p, d = (local, peer) if local_is_producer else (peer, local)
    err = mapping_error(p.geometry.total_kv_heads, p.tp_size, d.geometry.total_kv_heads, d.tp_size)
    return None if err is None else f"incompatible with peer engine {peer.engine_id!r}: {err}"
