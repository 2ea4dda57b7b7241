"""Pull mode over real NIXL between two processes, driven through the scheduler halves like the engine does."""

import numpy as np
import pytest
from harness import Instance, expected_kv


def start(*insts: Instance) -> None:
    for i in insts:
        i.wait_ready()


@pytest.fixture(scope="module")
def pair():
    p = Instance("prefill", "pull", block_size=4)
    d = Instance("decode", "pull", block_size=4)
    start(p, d)
    yield p, d
    p.close()
    d.close()


def pull_once(p, d, rid, p_blocks, d_blocks, num_local, num_prompt):
    """P finishes rid; D gets P's params, allocates, receives. Returns D's cache before and after, and P's."""
    keep, params = p.call("finish", f"p-{rid}", p_blocks, num_prompt, {"do_remote_decode": True})
    assert keep and params["transfer_mode"] == "pull" and params["remote_port"] == p.info["side_channel_port"]
    assert d.call("needs", rid, params) is True
    before = d.kv()
    d.call("alloc", rid, d_blocks, num_local, num_prompt)
    kind, reason = d.wait_result(rid)
    assert kind == "finished", reason
    p.wait_send(f"p-{rid}")  # D's release notification freed P's blocks
    return before, d.kv()


def test_info_reports_bound_port(pair):
    p, d = pair
    assert p.info["side_channel_port"] > 0 and p.info["transfer_mode"] == "pull" and p.info["kv_role"] == "prefill"


def test_pull_exact_bytes_and_nothing_else(pair):
    p, d = pair
    p_kv = p.kv()
    before, after = pull_once(p, d, "r1", [5, 6, 9, 2], [3, 4, 11, 12], 0, 14)
    assert np.array_equal(after, expected_kv(before, p_kv, [3, 4, 11, 12], [5, 6, 9, 2], 0, 13))
    assert not np.array_equal(after, before)


def test_pull_skips_prefix_hit(pair):
    p, d = pair
    p_kv = p.kv()
    before, after = pull_once(p, d, "r2", [1, 2, 3], [7, 8, 13], 4, 11)  # D already has block 7 (tokens 0-3)
    assert np.array_equal(after, expected_kv(before, p_kv, [7, 8, 13], [1, 2, 3], 4, 6))
    assert np.array_equal(after[:, :, 7], before[:, :, 7])


def test_zero_token_pull_releases_p(pair):
    p, d = pair
    before, after = pull_once(p, d, "r3", [4, 5], [14, 15], 4, 5)  # only the last token, which D recomputes
    assert np.array_equal(after, before)


def test_stats_count_bytes(pair):
    p, d = pair
    s = d.call("stats")
    assert s["received_bytes"] > 0 and s["transfers_ok"] >= 1 and s["transfer_seconds"]
    assert p.call("stats")["sent_bytes"] > 0


def test_bad_params_fail_cleanly(pair):
    p, d = pair
    assert d.call("needs", "bad1", {"do_remote_prefill": True, "transfer_mode": "pull"})
    d.call("alloc", "bad1", [0, 1], 0, 6)
    kind, reason = d.wait_result("bad1")
    assert kind == "failed" and "remote_block_ids" in reason
    _, params = p.call("finish", "p-bad2", [0], 3, {"do_remote_decode": True})
    d.call("needs", "bad2", dict(params, remote_block_ids=[99]))
    d.call("alloc", "bad2", [0], 0, 3)
    kind, reason = d.wait_result("bad2")
    assert kind == "failed" and "outside" in reason
    p.wait_send("p-bad2")  # D told P to let go anyway


@pytest.mark.parametrize("p_bs,d_bs", [(4, 8), (8, 4)])
def test_pull_different_block_sizes(p_bs, d_bs):
    p = Instance("prefill", "pull", block_size=p_bs)
    d = Instance("decode", "pull", block_size=d_bs)
    try:
        start(p, d)
        p_kv = p.kv()
        n = 22
        p_blocks = [9, 3, 4, 5, 0, 1][: -(-n // p_bs)]
        d_blocks = [2, 8, 9, 10, 11, 6][: -(-n // d_bs)]
        before, after = pull_once(p, d, "x", p_blocks, d_blocks, d_bs, n)  # one prefix-hit block on D
        assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, d_bs, n - 1 - d_bs))
    finally:
        p.close()
        d.close()


def test_lease_expiry_frees_p_blocks():
    p = Instance("prefill", "pull", lease_s=0.3).wait_ready()
    try:
        keep, _ = p.call("finish", "never-read", [0, 1], 6, {"do_remote_decode": True})
        assert keep
        p.wait_send("never-read", timeout=5)
        assert p.call("stats")["transfers_expired"] == 1
    finally:
        p.close()


def test_mode_mismatch_refused_with_both_modes_named():
    p = Instance("prefill", "push")
    d = Instance("decode", "pull")
    try:
        start(p, d)
        params = {"do_remote_prefill": True, "remote_engine_id": p.info["engine_id"], "remote_host": "127.0.0.1",
                  "remote_port": p.info["side_channel_port"], "remote_block_ids": [0], "remote_request_id": "q",
                  "remote_num_tokens": 3, "transfer_mode": "pull"}  # fmt: skip
        d.call("needs", "m1", params)
        d.call("alloc", "m1", [0], 0, 3)
        kind, reason = d.wait_result("m1")
        assert kind == "failed" and "peer is in push mode, this instance is in pull mode" in reason
    finally:
        p.close()
        d.close()


def test_dead_prefill_fails_recv_not_crash():
    p = Instance("prefill", "pull")
    d = Instance("decode", "pull")
    try:
        start(p, d)
        _, params = p.call("finish", "p-a", [0, 1], 8, {"do_remote_decode": True})
        d.call("needs", "a", params)
        d.call("alloc", "a", [0, 1], 0, 8)
        assert d.wait_result("a")[0] == "finished"  # handshake cached, agent loaded
        _, params = p.call("finish", "p-b", [2, 3], 8, {"do_remote_decode": True})
        p.kill()
        d.call("needs", "b", params)
        d.call("alloc", "b", [2, 3], 0, 8)
        kind, reason = d.wait_result("b", timeout=15)
        assert kind == "failed", reason
        # D keeps serving: a fresh P works
        p2 = Instance("prefill", "pull").wait_ready()
        try:
            _, params = p2.call("finish", "p-c", [0, 1], 8, {"do_remote_decode": True})
            d.call("needs", "c", params)
            d.call("alloc", "c", [4, 5], 0, 8)
            assert d.wait_result("c")[0] == "finished"
        finally:
            p2.close()
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                  "remote_block_ids": [0], "remote_request_id": "z", "remote_num_tokens": 3}  # fmt: skip
        d.call("needs", "unreachable", params)
        d.call("alloc", "unreachable", [6], 0, 3)
        kind, reason = d.wait_result("unreachable")
        assert kind == "failed" and "refused" in reason
    finally:
        p.close()
        d.close()


def test_abort_during_handshake_is_cancelled():
    d = Instance("decode", "pull").wait_ready()
    try:
        # a side channel that accepts but never answers: the handshake hangs until aborted
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": s.getsockname()[1],
                  "remote_block_ids": [0], "remote_request_id": "z", "remote_num_tokens": 3}  # fmt: skip
        d.call("needs", "ab", params)
        d.call("alloc", "ab", [1], 0, 3)
        d.call("abort", "ab")
        assert d.wait_result("ab") == ("cancelled", None)
        s.close()
    finally:
        d.close()
