"""Wire messages: round trips, refusal of malformed input, compatibility errors naming both sides."""

import dataclasses

import msgpack
import pytest

from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.groups import KVGroup, KVGroups
from pdserve.transfer.wire import (
    WIRE_VERSION,
    HandshakeReply,
    HandshakeRequest,
    PeerInfo,
    Ping,
    Pong,
    WireError,
    decode,
    encode,
)
from pdserve.transfer.wire_compat import compat_hash, compat_values, incompatibility
from pdserve.transfer.wire_notifs import (
    PullRelease,
    PullReleaseAck,
    PushCancelAck,
    PushDone,
    PushQueued,
    PushRegister,
)


def info(**kw) -> PeerInfo:
    """A handshake of a 2-layer, 2-KV-head float32 model (keyword arguments override its fields, or the
    geometry's: num_layers, block_size, num_kv_heads, group_windows, group_layers)."""
    layers = kw.pop("group_layers", None) or [list(range(kw.pop("num_layers", 2)))]
    windows = kw.pop("group_windows", [0] * len(layers))
    groups = KVGroups(tuple(KVGroup(w or None, tuple(t)) for w, t in zip(windows, layers, strict=True)), len(layers[0]))
    geometry = CacheGeometry(16, kw.pop("block_size", 4), kw.pop("num_kv_heads", 2), 2, 4, 4, groups)
    v = dict(model_name="m", dtype="float32", transfer_mode="pull", wire_version=WIRE_VERSION, tp_size=1)
    v.update(kw)
    peer = PeerInfo(engine_id="e1", agent_name="a1", agent_metadata=b"\x00md", geometry=geometry, base_addr=1 << 40,
                    device_id=0, memory="DRAM", tp_rank=0, rank_ports=[5000, 5001], compat_hash="",
                    epoch=1_700_000_000_000_000_000, **v)  # fmt: skip
    return dataclasses.replace(peer, compat_hash=compat_hash(compat_values(peer)))


@pytest.mark.parametrize(
    "msg",
    [
        Ping(),
        PullRelease("r1", True, 123, [4, 5]),
        PullReleaseAck("r1", False, "the lease expired"),
        PullRelease("r1", True, 123, [4, 5], [1, 2], [[0, 31], [16, 31]]),  # --kv-checksum: what D asks P to sum
        PullReleaseAck("r1", True, "", [12345, -(1 << 63)]),  # (int64 sums, signed)
        PushDone("t1", 0, 1, 2, 4096, [7, (1 << 63) - 1]),
        Pong("e1", "a1", 7),
        PushRegister("t1", 2, "d", [1, 2, 3], 16, 16, 31, 0, 15000, []),
        PushRegister("t1", 2, "d", [1, 2, 3], 16, 16, 31, 0, 15000, [[1, 2, 3], [-1, 4, 5]]),
        PushQueued("t1", 2),
        PushCancelAck("t1", 0, 0, False),
        HandshakeRequest(info(), True),
        HandshakeReply(True, info(), ""),
        HandshakeReply(False, None, "no"),
    ],
)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb({"type": "Ping", "v": WIRE_VERSION + 1}), "wire version"),
        (msgpack.packb({"type": "Nope", "v": WIRE_VERSION}), "unknown message type"),
        (msgpack.packb({"type": "PullRelease", "v": WIRE_VERSION, "request_id": "r"}), "missing fields"),
        (
            msgpack.packb(
                {
                    "type": "PullRelease",
                    "v": WIRE_VERSION,
                    "request_id": 1,
                    "ok": True,
                    "num_bytes": 1,
                    "block_ids": [],
                    "checksum_heads": [],
                    "checksum_ranges": [],
                }
            ),
            "expected str",
        ),  # fmt: skip
        (
            msgpack.packb(
                {
                    "type": "PushRegister",
                    "v": WIRE_VERSION,
                    "transfer_id": "t",
                    "attempt": 0,
                    "engine_id": "d",
                    "block_ids": [1, "x"],
                    "block_size": 4,
                    "start_token": 0,
                    "num_tokens": 1,
                    "tp_rank": 0,
                    "keepalive_ms": 1000,
                    "block_tables": [],
                }
            ),
            "list of int",
        ),  # fmt: skip
        (
            msgpack.packb(
                {
                    "type": "PullRelease",
                    "v": WIRE_VERSION,
                    "request_id": "r",
                    "ok": 1,
                    "num_bytes": 1,
                    "block_ids": [],
                    "checksum_heads": [],
                    "checksum_ranges": [],
                }
            ),
            "expected bool",
        ),  # fmt: skip
    ],
)
def test_malformed_is_refused(raw, match):
    with pytest.raises(WireError, match=match):
        decode(raw)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"block_size": "4"}, "geometry.block_size: expected int"),
        ({"num_blocks": -1}, "num_blocks must be an int >= 0"),
        ({"group_layers": [[0], [1, 2]]}, "bad KV groups"),
        ({"group_windows": [0, 8]}, "bad KV groups"),
    ],
)
def test_malformed_geometry_is_refused(change, match):
    raw = msgpack.unpackb(encode(HandshakeRequest(info(), False)))
    raw["peer"]["geometry"].update(change)
    with pytest.raises(WireError, match=match):
        decode(msgpack.packb(raw))


def test_never_pickle():
    assert b"pickle" not in encode(HandshakeRequest(info(), False))
    assert isinstance(msgpack.unpackb(encode(Ping())), dict)


def test_compatible_and_mode_mismatch_names_both_sides():
    assert incompatibility(info(), info()) is None
    err = incompatibility(info(transfer_mode="pull"), info(transfer_mode="push"))
    assert "peer is in push mode, this instance is in pull mode" in err
    err = incompatibility(info(num_layers=2, dtype="float32"), info(num_layers=3, dtype="bfloat16"))
    assert "num_layers: peer has 3, this instance has 2" in err and "'bfloat16'" in err


def test_forged_hash_is_refused():
    bad = dataclasses.replace(info(), compat_hash="0" * 16)
    assert "compatibility hash" in incompatibility(info(), bad)


def test_tp_mapping_that_cannot_work_names_both_sides():
    # 2 KV heads: P TP 2 (one head each) -> D TP 4 (replicated) maps; P TP 3 can neither split nor replicate
    assert incompatibility(info(tp_size=4, num_kv_heads=1), info(tp_size=2, num_kv_heads=1)) is None
    err = incompatibility(info(tp_size=4, num_kv_heads=1), info(tp_size=3, num_kv_heads=1))
    assert err is not None and "prefill TP 3 with 2 KV heads, decode TP 4 with 2 KV heads" in err
    err = incompatibility(info(tp_size=3, num_kv_heads=1), info(tp_size=1), local_is_producer=True)
    assert err is not None and "prefill TP 3 with 2 KV heads, decode TP 1 with 2 KV heads" in err


def test_kv_groups_that_disagree_are_refused_naming_both():
    windowed = dict(group_windows=[0, 8], group_layers=[[0], [1]])
    err = incompatibility(info(), info(**windowed))
    assert err is not None
    assert "KV groups: peer has [full layers [0], window 8 layers [1]]" in err
    assert "this instance has [full layers [0, 1]]" in err
    assert err.count("KV groups") == 1
    assert incompatibility(info(**windowed), info(**windowed)) is None


def test_any_block_sizes_pair_windowed_or_not():
    windowed = dict(group_windows=[0, 8], group_layers=[[0], [1]])
    assert incompatibility(info(block_size=4, **windowed), info(block_size=16, **windowed)) is None
    assert incompatibility(info(block_size=16, **windowed), info(block_size=4, **windowed)) is None
    assert incompatibility(info(block_size=4), info(block_size=8)) is None  # full attention


def test_kv_checksum_setting_must_agree():
    """--kv-checksum on one side only: the handshake is refused, naming both settings."""
    assert incompatibility(info(kv_checksum=True), info(kv_checksum=True)) is None
    err = incompatibility(info(kv_checksum=True), info(kv_checksum=False))
    assert "--kv-checksum is off on the peer, on on this instance" in err
    err = incompatibility(info(), info(kv_checksum=True))
    assert "--kv-checksum is on on the peer, off on this instance" in err
