"""GET /kv_events against a real `pdserve serve` of the tiny Llama (issue 29, item 1), one server for every case
(keys set: a client key and an internal credential): the events name exactly the full blocks of two prompts
sharing a prefix (hashed here with the engine's own function), a snapshot then holds exactly those, a poll with
nothing new answers empty after wait_s; the route is internal (401 without the internal credential, 400 naming a
bad parameter); and a restart on the same address answers a poll of the old epoch with a new epoch's snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import Launcher, Proc, post, wait_idle

from pdserve.kv.block_hashes import HASH_SCHEME, prompt_block_hashes
from pdserve.kv.events_wire import KVEventsAnswer, decode_answer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIENT_KEY = "client-key-0123456789"
INTERNAL_KEY = "internal-key-9876543210"
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
INTERNAL = {"Authorization": f"Bearer {INTERNAL_KEY}"}
BLOCK_SIZE = 16  # pdserve serve's default --block-size
PROMPT_A = [5 + i % 90 for i in range(40)]  # 2 full blocks + 8 tokens
PROMPT_B = PROMPT_A[:32] + [100 + i for i in range(20)]  # shares A's 2 full blocks, then 1 of its own + 4 tokens


@pytest.fixture(scope="module")
def servers(launcher: Launcher, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Proc]:
    """The instance, as a list: the restart case appends its successor."""
    key_file = tmp_path_factory.mktemp("keys") / "internal"
    key_file.write_text(INTERNAL_KEY + "\n")
    key_file.chmod(0o600)
    proc = launcher.serve(tiny_llama, "--api-key", CLIENT_KEY, "--internal-api-key-file", str(key_file), name="serve")
    launcher.wait_ready()
    return [proc]


def kv_events(proc: Proc, headers: dict[str, str] | None = INTERNAL, **params: Any) -> httpx.Response:
    return httpx.get(proc.url + "/kv_events", params=params, headers=headers, timeout=30, trust_env=False)


def poll(proc: Proc, after: int | None = None, epoch: str | None = None, wait_s: float = 2.0) -> KVEventsAnswer:
    params: dict[str, Any] = {"wait_s": wait_s} if after is None else {"after": after, "epoch": epoch, "wait_s": wait_s}
    resp = kv_events(proc, **params)
    assert resp.status_code == 200, resp.text
    return decode_answer(resp.json(), after)


def complete(proc: Proc, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}  # no output block fills
    resp = post(proc.url, "/v1/completions", body, CLIENT)
    assert resp.status_code == 200, resp.text


def test_events_name_exactly_the_full_blocks_of_the_prompts(servers: list[Proc]) -> None:
    proc = servers[-1]
    first = poll(proc)
    snap = first.snapshot
    assert snap is not None and snap.reason == "first" and snap.keys == []
    assert (snap.block_size, snap.prefix_caching, snap.hash_scheme) == (BLOCK_SIZE, True, HASH_SCHEME)
    complete(proc, PROMPT_A)
    complete(proc, PROMPT_B)  # its first 2 blocks are prefix hits: already cached, no event
    a, b = prompt_block_hashes(PROMPT_A, BLOCK_SIZE), prompt_block_hashes(PROMPT_B, BLOCK_SIZE)
    assert len(a) == 2 and len(b) == 3 and b[:2] == a
    answer = poll(proc, first.seq, first.epoch)  # the events are recorded before the answers leave
    assert answer.epoch == first.epoch and answer.snapshot is None
    assert answer.events == [(True, [*a, b[2]])] and answer.seq == first.seq + 3
    again = poll(proc)  # a new consumer: the snapshot holds exactly those blocks, at the same seq
    assert again.snapshot is not None and sorted(again.snapshot.keys) == sorted(b) and again.seq == answer.seq
    quiet = poll(proc, answer.seq, answer.epoch, wait_s=0.3)  # nothing new: an empty answer after wait_s
    assert quiet.events == [] and quiet.snapshot is None and quiet.seq == answer.seq
    m = wait_idle(proc.url, headers=CLIENT)  # every block free again (the cached ones are evictable)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"]


def test_the_route_is_internal_and_names_a_bad_parameter(servers: list[Proc]) -> None:
    proc = servers[-1]
    assert kv_events(proc, headers=None).status_code == 401
    assert kv_events(proc, headers=CLIENT).status_code == 401  # the client key does not open an internal route
    bad = kv_events(proc, after=1)
    assert bad.status_code == 400 and "after and epoch" in bad.json()["error"]["message"]
    assert kv_events(proc, wait_s=0).status_code == 200


def test_a_restart_answers_the_old_epoch_with_a_new_snapshot(launcher: Launcher, servers: list[Proc]) -> None:
    old = servers[-1]
    complete(old, PROMPT_A)  # cached already if the first case ran: then a hit, no event
    before = poll(old, wait_s=0)
    assert before.snapshot is not None and before.snapshot.keys
    old.stop()
    servers.append(launcher.start("serve-again", old.argv_on_same_port(), old.port))
    launcher.wait_ready()
    after = poll(servers[-1], before.seq, before.epoch)
    assert after.epoch != before.epoch and after.snapshot is not None
    assert after.snapshot.reason == "epoch" and after.snapshot.keys == [] and after.seq == 0
    health = httpx.get(servers[-1].url + "/health", timeout=10, trust_env=False).json()
    assert health["epoch"] == after.epoch
