"""Issue 11's attacks against 1P1D pairs with a deployment secret, each now refused or harmless.

Pull pair (P_pull, D_pull) and push pair (P_push, D_push), each behind its router, all with one secret (a
0600 file). The tests play the attacker with plain HTTP and TCP: forged, altered, replayed, expired and
unsigned coordinates, a genuine capability sent with another prompt (prefix-cache poisoning), forged push
transfer ids on both legs, a third party on the side channel. The last test checks that nothing leaked:
every instance's blocks are free again, and legitimate requests through both routers still get the
colocated answer (computed by P_pull on its own, without transfer params).
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import Launcher, Proc, post, scrape_metrics, wait_idle

from pdserve.auth import Signer, new_secret
from pdserve.kv.capability import PULL, pull_fields
from pdserve.kv.decode import decode
from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer import wire

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 4}
GERMANY = "Question: what is the capital of Germany? Answer: the capital of Germany is"
FRANCE = "Question: what is the capital of France?? Answer: the capital of France is"
LEASE_S = 3.0  # P's lease: blocks pinned by a refused D leg come back after this long


@dataclass
class Pairs:
    secret: str
    p_pull: Proc
    d_pull: Proc
    p_push: Proc
    d_push: Proc
    r_pull: Proc
    r_push: Proc

    @property
    def instances(self) -> list[Proc]:
        return [self.p_pull, self.d_pull, self.p_push, self.d_push]


@pytest.fixture(scope="module")
def pairs(launcher: Launcher, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Pairs:
    secret = new_secret()
    path = tmp_path_factory.mktemp("secret") / "kv_auth_secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    auth = ["--kv-auth-secret-file", str(path)]

    def serve(name: str, *args: str) -> Proc:
        return launcher.serve(
            tiny_llama, "--num-gpu-blocks", "64", "--kv-lease-s", str(LEASE_S), *auth, *args, name=name
        )

    p_pull = serve("P_pull", "--kv-role", "prefill", "--kv-transfer", "pull")
    d_pull = serve("D_pull", "--kv-role", "decode", "--kv-transfer", "pull")
    p_push = serve("P_push", "--kv-role", "prefill", "--kv-transfer", "push")
    d_push = serve("D_push", "--kv-role", "decode", "--kv-transfer", "push")
    launcher.wait_ready()
    r_pull = launcher.proxy("pull", [p_pull], [d_pull], *auth, name="router-pull")
    r_push = launcher.proxy("push", [p_push], [d_push], *auth, name="router-push")
    launcher.wait_ready()
    return Pairs(secret, p_pull, d_pull, p_push, d_push, r_pull, r_push)


def completion(prompt: str, kv: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, **GREEDY}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def colocated(pairs: Pairs, prompt: str) -> list[int]:
    r = post(pairs.p_pull.url, "/v1/completions", completion(prompt))  # no params: P computes it all itself
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def prefill(pairs: Pairs, prompt: str) -> dict[str, Any]:
    """Play the router's prefill leg on P_pull: P's signed answer (a capability for this prompt's KV)."""
    body = {**completion(prompt), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(pairs.p_pull.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()["kv_transfer_params"]
    assert "kv_capability" in answer and answer["kv_capability"]["prompt_digest"]
    return answer


def received_bytes(proc: Proc) -> float:
    m = scrape_metrics(proc.url)
    return sum(v for k, v in m.items() if k.startswith("pdserve_kv_received_bytes"))


def assert_refused(pairs: Pairs, proc: Proc, body: dict[str, Any], *words: str) -> None:
    """proc answers 403 naming the problem, and allocated and read nothing."""
    before = received_bytes(proc)
    r = post(proc.url, "/v1/completions", body)
    assert r.status_code == 403, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    m = scrape_metrics(proc.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]
    assert m["pdserve_requests_waiting_for_kv"] == 0
    assert received_bytes(proc) == before


def test_cross_user_read_refused(pairs: Pairs) -> None:
    victim = prefill(pairs, "My card number is 4111 1111 1111 1111; keep it secret. Repeat it:")
    attacker = "x " * 33 + " is"
    unsigned = {k: v for k, v in victim.items() if k != "kv_capability"}
    assert_refused(pairs, pairs.d_pull, completion(attacker, unsigned), "unsigned")
    forged = {**victim, "kv_capability": {**victim["kv_capability"], "mac": "0" * 64}}
    assert_refused(pairs, pairs.d_pull, completion(attacker, forged), "forged or altered")
    # the genuine capability with the attacker's own prompt: the KV it names is of other tokens
    assert_refused(pairs, pairs.d_pull, completion(attacker, victim), "other tokens")


def test_prefix_cache_poisoning_refused(pairs: Pairs) -> None:
    germany = prefill(pairs, GERMANY)
    assert_refused(pairs, pairs.d_pull, completion(FRANCE, germany), "other tokens")
    r = post(pairs.r_pull.url, "/v1/completions", completion(FRANCE))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == colocated(pairs, FRANCE)


def test_altered_replayed_expired_capabilities(pairs: Pairs) -> None:
    answer = prefill(pairs, GERMANY)
    altered = {**answer, "remote_block_ids": list(reversed(answer["remote_block_ids"]))}
    assert_refused(pairs, pairs.d_pull, completion(GERMANY, altered), "forged or altered")
    for key, value in (("remote_host", "10.0.0.9"), ("remote_port", 1), ("remote_num_tokens", 1)):
        assert_refused(pairs, pairs.d_pull, completion(GERMANY, {**answer, key: value}), "forged or altered")
    # expired: a genuine MAC (signed with the deployment's secret) whose expiry has passed
    src = decode(answer)
    assert src.capability is not None
    past = round(time.time() - 5, 3)
    mac = Signer(pairs.secret.encode()).sign(PULL, pull_fields(src, past, src.capability.prompt_digest))
    expired = {**answer, "kv_capability": {**answer["kv_capability"], "expires_at": past, "mac": mac}}
    assert_refused(pairs, pairs.d_pull, completion(GERMANY, expired), "expired")
    # the genuine one: served once, equal to the colocated answer; then refused as a replay. A fresh answer:
    # the refusals above may take longer than the 3 s lease on a loaded machine (CI saw "expired 0 s ago")
    answer = prefill(pairs, GERMANY)
    r = post(pairs.d_pull.url, "/v1/completions", completion(GERMANY, answer))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == colocated(pairs, GERMANY)
    assert_refused(pairs, pairs.d_pull, completion(GERMANY, answer), "replayed")


def test_forged_push_transfer_refused_on_both_legs(pairs: Pairs) -> None:
    info = post(pairs.p_push.url, "/v1/completions", completion(FRANCE)).status_code  # (P answers plain requests)
    assert info == 200
    tid = "attacker-chosen-transfer"
    wrong = Signer(new_secret().encode()).sign("push", [tid, "x", "127.0.0.1", 1, time.time() + 60])
    for cap in (None, {"expires_at": time.time() + 60, "mac": wrong}):
        p_leg = {"do_remote_decode": True, "transfer_id": tid, "transfer_mode": "push"}
        d_leg = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1", "remote_port": 5600,
                 "remote_engine_id": "p", "transfer_mode": "push"}  # fmt: skip
        if cap is not None:
            p_leg["kv_capability"] = d_leg["kv_capability"] = cap
        word = "unsigned" if cap is None else "forged or altered"
        assert_refused(pairs, pairs.p_push, completion(FRANCE, p_leg), word)
        assert_refused(pairs, pairs.d_push, completion(FRANCE, d_leg), word)


def side_channel_exchange(port: int, msg: wire.Message) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = wire.encode(msg)
        s.sendall(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)


def test_third_party_on_the_side_channel_learns_nothing(pairs: Pairs) -> None:
    for proc in (pairs.p_pull, pairs.p_push, pairs.d_push):
        info = post_get(proc.url + "/kv_transfer/info")
        fake = wire.PeerInfo(
            engine_id="intruder", agent_name="intruder-agent", agent_metadata=b"\x00" * 64, model_name="tiny",
            dtype="float32", transfer_mode=info["transfer_mode"], wire_version=wire.WIRE_VERSION,
            geometry=CacheGeometry.of((), 2, 2, 16, 4, 16, 1), base_addr=0, device_id=0, memory="DRAM", tp_rank=0,
            tp_size=1, rank_ports=[], compat_hash="0", epoch=1,
        )  # fmt: skip
        forged_seal = wire.Sealed("00" * 16, int(time.time() * 1000), "0" * 64, wire.encode(wire.Ping()))
        for msg in (wire.HandshakeRequest(fake, True), wire.Ping(), forged_seal):
            raw = side_channel_exchange(info["side_channel_port"], msg)
            reply = wire.decode(raw)
            assert isinstance(reply, wire.Refused), reply
            assert info["engine_id"].encode() not in raw and b"agent" not in raw and b"base_addr" not in raw
            assert len(raw) < 200, raw


def post_get(url: str) -> dict[str, Any]:
    import httpx

    r = httpx.get(url, timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def test_afterwards_all_free_and_legitimate_requests_work(pairs: Pairs) -> None:
    for router in (pairs.r_pull, pairs.r_push):
        for prompt in (GERMANY, FRANCE):
            r = post(router.url, "/v1/completions", completion(prompt))
            assert r.status_code == 200, (router.name, r.text)
            assert r.json()["choices"][0]["token_ids"] == colocated(pairs, prompt)
    for proc in pairs.instances:
        m = wait_idle(proc.url, timeout_s=LEASE_S + 20)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name
