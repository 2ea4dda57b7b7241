"""Capabilities on kv_transfer_params (kv/capability.py): issue, round-trip through JSON, verify."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.auth import AuthError, is_loopback, unauthenticated_listen_error
from pdserve.kv.capability import KVAuth
from pdserve.kv.decode import decode
from pdserve.kv.params import Mode, PullSource, PushSource, RemoteDecode, encode

SECRET = b"s" * 32
PROMPT = list(range(100, 140))
SRC = PullSource("127.0.0.1", 5600, "p-1", "req-1", (4, 5, 6), 40, 16)
P_INFO = {"engine_id": "p-1", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def wire(value):  # through the HTTP edge: JSON text and back
    return decode(json.loads(json.dumps(encode(value))))


def test_pull_capability_verifies_once_and_binds_everything() -> None:
    clock = Clock()
    issued = KVAuth(SECRET, clock).issue_pull(SRC, PROMPT, ttl_s=30)
    assert issued.capability is not None and wire(issued) == issued
    d = KVAuth(SECRET, clock)
    d.check(wire(issued), PROMPT + [7, 8], {})  # a longer prompt with the same first 40 tokens is fine
    with pytest.raises(AuthError, match="replayed"):
        d.check(wire(issued), PROMPT, {})
    for field, value in (("block_ids", (4, 5, 7)), ("num_tokens", 39), ("request_id", "req-2"), ("host", "10.0.0.1"),
                         ("port", 5601), ("engine_id", "p-2"), ("block_size", 32), ("tp_size", 2)):  # fmt: skip
        with pytest.raises(AuthError, match="forged or altered"):
            KVAuth(SECRET, clock).check(dataclasses.replace(issued, **{field: value}), PROMPT, {})
    with pytest.raises(AuthError, match="other tokens"):
        KVAuth(SECRET, clock).check(issued, PROMPT[:-1] + [0], {})
    with pytest.raises(AuthError, match="other tokens"):
        KVAuth(SECRET, clock).check(issued, PROMPT[:39], {})  # shorter than the KV it names
    with pytest.raises(AuthError, match="other tokens"):  # an id no int64 holds: refused, not a digest crash
        KVAuth(SECRET, clock).check(issued, PROMPT[:-1] + [2**64], {})
    with pytest.raises(AuthError, match="forged or altered"):
        KVAuth(b"t" * 32, clock).check(issued, PROMPT, {})  # another deployment's secret
    clock.now += 31
    with pytest.raises(AuthError, match="expired"):
        KVAuth(SECRET, clock).check(issued, PROMPT, {})


def test_unsigned_refused_only_with_a_secret() -> None:
    with pytest.raises(AuthError, match="unsigned"):
        KVAuth(SECRET).check(SRC, PROMPT, {})
    KVAuth(None).check(SRC, PROMPT, {})  # no secret: as before
    assert KVAuth(None).issue_pull(SRC, PROMPT, 30) == SRC
    KVAuth(SECRET).check(RemoteDecode(None, None), PROMPT, P_INFO)  # a pull prefill leg names nothing


def test_push_capability_on_both_legs() -> None:
    clock = Clock()
    cap = KVAuth(SECRET, clock).issue_push("t-1", "p-1", "127.0.0.1", 5600, ttl_s=600)
    p_leg, d_leg = RemoteDecode(Mode.PUSH, "t-1", cap), PushSource("t-1", "127.0.0.1", 5600, "p-1", 1, cap)
    assert wire(p_leg) == p_leg and wire(d_leg) == d_leg
    KVAuth(SECRET, clock).check(p_leg, PROMPT, P_INFO)
    KVAuth(SECRET, clock).check(d_leg, PROMPT, {})
    with pytest.raises(AuthError, match="forged or altered"):  # a capability for another P
        KVAuth(SECRET, clock).check(p_leg, PROMPT, {**P_INFO, "engine_id": "p-2"})
    with pytest.raises(AuthError, match="forged or altered"):  # D sent to dial somewhere else
        KVAuth(SECRET, clock).check(dataclasses.replace(d_leg, port=6000), PROMPT, {})
    with pytest.raises(AuthError, match="forged or altered"):  # another transfer id
        KVAuth(SECRET, clock).check(dataclasses.replace(p_leg, transfer_id="t-2"), PROMPT, P_INFO)
    with pytest.raises(AuthError, match="unsigned"):
        KVAuth(SECRET, clock).check(RemoteDecode(Mode.PUSH, "t-1"), PROMPT, P_INFO)


def test_malformed_capability_is_a_params_error() -> None:
    raw = encode(SRC)
    for bad in ("x", {"mac": "ab"}, {"expires_at": "soon", "mac": "ab"}, {"expires_at": 1.0, "mac": 5}):
        with pytest.raises(ValueError, match="kv_capability"):
            decode({**raw, "kv_capability": bad})


def test_without_a_secret_d_dials_only_loopback_unless_allowed() -> None:
    far = dataclasses.replace(SRC, host="10.0.0.9")
    with pytest.raises(AuthError, match="not a loopback address"):
        KVAuth(None).check(far, PROMPT, {})
    with pytest.raises(AuthError, match="not a loopback address"):
        KVAuth(None).check(PushSource("t", "example.com", 5600, "p-1"), PROMPT, {})  # names are never resolved
    for host in ("127.0.0.2", "::1", "localhost"):
        KVAuth(None).check(dataclasses.replace(SRC, host=host), PROMPT, {})
    KVAuth(None, allow_unsigned_remote=True).check(far, PROMPT, {})  # --insecure-no-kv-auth


def test_listening_beyond_loopback_without_a_secret_is_refused_naming_the_flag() -> None:
    assert unauthenticated_listen_error({"--host": "127.0.0.1", "--kv-side-channel-host": "localhost"}) is None
    error = unauthenticated_listen_error({"--host": "0.0.0.0", "--kv-side-channel-host": "127.0.0.1"})
    assert error is not None and "--host 0.0.0.0" in error and "--insecure-no-kv-auth" in error
    assert not is_loopback("10.0.0.1") and is_loopback("127.1.2.3") and not is_loopback("::")


def test_without_a_secret_kv_is_given_back_only_where_d_would_dial() -> None:
    far = dataclasses.replace(SRC, host="10.0.0.9")
    assert KVAuth(None).may_give_back(SRC) and not KVAuth(None).may_give_back(far)
    assert KVAuth(None, allow_unsigned_remote=True).may_give_back(far)


def test_a_release_needs_the_requests_own_capability() -> None:
    """POST /kv_transfer/release without the internal key: P's own pull answer (expired is fine: the MAC alone)
    or the push leg's params, for this instance; never an id alone, another request's, or a forged one."""
    clock = Clock()
    p = KVAuth(SECRET, clock)
    answer = p.issue_pull(SRC, PROMPT, ttl_s=30)
    clock.now += 60  # past the lease: still the caller's to give up
    p.check_release("req-1", None, wire(answer), P_INFO)
    p.check_release("req-1", None, wire(answer), P_INFO)  # not used up
    for rid, params, words in (
        ("req-1", None, "its id alone is not enough"),
        ("req-1", SRC, "its id alone is not enough"),  # unsigned
        ("req-2", answer, "not P's answer for request_id 'req-2'"),
        ("req-1", dataclasses.replace(answer, block_ids=(4, 5)), "forged or altered"),
    ):
        with pytest.raises(AuthError, match=words):
            p.check_release(rid, None, params, P_INFO)
    with pytest.raises(AuthError, match="another prefill instance"):
        p.check_release("req-1", None, answer, {**P_INFO, "engine_id": "p-2"})
    cap = KVAuth(SECRET, clock).issue_push("t-1", "p-1", "127.0.0.1", 5600, ttl_s=600)
    p_leg = RemoteDecode(Mode.PUSH, "t-1", cap)
    p.check(p_leg, PROMPT, P_INFO)  # the leg was admitted: its release still holds the same capability
    p.check_release(None, "t-1", wire(p_leg), P_INFO)
    with pytest.raises(AuthError, match="not the prefill leg's for transfer_id 't-2'"):
        p.check_release(None, "t-2", p_leg, P_INFO)
    with pytest.raises(AuthError, match="forged or altered"):  # issued for another P
        p.check_release(None, "t-1", p_leg, {**P_INFO, "side_channel_port": 5601})
    KVAuth(None).check_release("req-1", None, None, P_INFO)  # without a secret nothing can be checked
