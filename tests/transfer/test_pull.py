"""Pull mode over real NIXL between processes, driven through the scheduler halves like the engine does.
Instances are shared by the module (starting one costs seconds); request ids are unique per test."""

import socket
import time

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, start_all


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p4=Instance("prefill", "pull", block_size=4),
        d4=Instance("decode", "pull", block_size=4),
        p8=Instance("prefill", "pull", block_size=8, lease_s=1.0),
        d8=Instance("decode", "pull", block_size=8),
        p_kill=Instance("prefill", "pull", block_size=4),
        p_push=Instance("prefill", "push", block_size=4),
        d_short=Instance("decode", "pull", block_size=4, recv_timeout_s=0.5),
    )
    yield insts
    close_all(insts)


def pull_once(p, d, rid, p_blocks, d_blocks, num_local, num_prompt):
    """P finishes rid; D gets P's params, allocates, receives. Returns D's cache before and after."""
    keep, params = p.call("finish", f"p-{rid}", p_blocks, num_prompt, {"do_remote_decode": True})
    assert keep and params["transfer_mode"] == "pull" and params["remote_port"] == p.info["side_channel_port"]
    assert d.call("needs", rid, params) is True
    before = d.kv()
    d.call("alloc", rid, d_blocks, num_local, num_prompt)
    kind, reason = d.wait_result(rid)
    assert kind == "finished", reason
    p.wait_send(f"p-{rid}")  # D's release notification freed P's blocks
    return before, d.kv()


def test_info_reports_bound_port(cl):
    info = cl["p4"].info
    assert info["side_channel_port"] > 0 and info["transfer_mode"] == "pull" and info["kv_role"] == "prefill"
    assert set(info) >= {"engine_id", "side_channel_host", "tp_size", "block_size"}


def test_pull_exact_bytes_and_nothing_else(cl):
    p, d = cl["p4"], cl["d4"]
    p_kv = p.kv()
    before, after = pull_once(p, d, "r1", [5, 6, 9, 2], [3, 4, 11, 12], 0, 14)
    assert np.array_equal(after, expected_kv(before, p_kv, [3, 4, 11, 12], [5, 6, 9, 2], 0, 13))
    assert not np.array_equal(after, before)
    assert d.count("finished_recvs", "r1") == 1 and p.count("finished_sends", "p-r1") == 1


def test_pull_skips_prefix_hit(cl):
    p, d = cl["p4"], cl["d4"]
    p_kv = p.kv()
    before, after = pull_once(p, d, "r2", [1, 2, 3], [7, 8, 13], 4, 11)  # D already has block 7 (tokens 0-3)
    assert np.array_equal(after, expected_kv(before, p_kv, [7, 8, 13], [1, 2, 3], 4, 6))
    assert np.array_equal(after[7], before[7])


def test_zero_token_pull_releases_p(cl):
    before, after = pull_once(cl["p4"], cl["d4"], "r3", [4, 5], [14, 15], 4, 5)  # D recomputes the last token
    assert np.array_equal(after, before)


@pytest.mark.parametrize("p_name,d_name", [("p4", "d8"), ("p8", "d4")])
def test_pull_different_block_sizes(cl, p_name, d_name):
    p, d = cl[p_name], cl[d_name]
    p_kv, d_bs, p_bs, n = p.kv(), d.block_size, p.block_size, 22
    p_blocks = [9, 3, 4, 5, 0, 1][: -(-n // p_bs)]
    d_blocks = [2, 8, 9, 10, 11, 6][: -(-n // d_bs)]
    before, after = pull_once(p, d, f"x-{p_name}", p_blocks, d_blocks, d_bs, n)  # one prefix-hit block on D
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, d_bs, n - 1 - d_bs))


def test_stats_count_bytes(cl):
    s = cl["d4"].call("stats")
    assert s["received_bytes"] > 0 and s["transfers_ok"] >= 1 and s["transfer_seconds"]
    assert cl["p4"].call("stats")["sent_bytes"] > 0


def test_bad_params_fail_cleanly(cl):
    p, d = cl["p4"], cl["d4"]
    with pytest.raises(ValueError, match="remote_block_ids"):  # refused at the edge, before any allocation
        d.call("needs", "bad1", {"do_remote_prefill": True, "transfer_mode": "pull"})
    _, params = p.call("finish", "p-bad2", [0], 3, {"do_remote_decode": True})
    d.call("needs", "bad2", dict(params, remote_block_ids=[99]))
    d.call("alloc", "bad2", [0], 0, 3)
    kind, reason = d.wait_result("bad2")
    assert kind == "failed" and "outside" in reason
    with pytest.raises(TimeoutError):  # D's release names blocks [99]: P keeps a pin it does not match
        p.wait_send("p-bad2", timeout=0.5)
    p.call("release", "p-bad2")  # the engine's release (abort, or the router's) frees it at once
    p.wait_send("p-bad2", timeout=2)


def test_lease_expiry_frees_p_blocks(cl):
    p = cl["p8"]  # lease 1 s
    keep, _ = p.call("finish", "never-read", [0, 1], 6, {"do_remote_decode": True})
    assert keep
    p.wait_send("never-read", timeout=5)
    assert p.call("stats")["transfers_expired"] == 1


def test_mode_mismatch_refused_with_both_modes_named(cl):
    p, d = cl["p_push"], cl["d4"]
    params = {"do_remote_prefill": True, "remote_engine_id": p.info["engine_id"], "remote_host": "127.0.0.1",
              "remote_port": p.info["side_channel_port"], "remote_block_ids": [0], "remote_request_id": "q",
              "remote_num_tokens": 3, "transfer_mode": "pull"}  # fmt: skip
    d.call("needs", "m1", params)
    d.call("alloc", "m1", [0], 0, 3)
    kind, reason = d.wait_result("m1")
    assert kind == "failed" and "peer is in push mode, this instance is in pull mode" in reason


def test_abort_during_handshake_is_cancelled(cl):
    d = cl["d4"]
    s = socket.socket()  # a side channel that accepts but never answers: the handshake hangs
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": s.getsockname()[1],
                  "remote_block_ids": [0], "remote_request_id": "z", "remote_num_tokens": 3}  # fmt: skip
        d.call("needs", "ab", params)
        d.call("alloc", "ab", [1], 0, 3)
        d.call("abort", "ab")
        assert d.wait_result("ab") == ("cancelled", None)
    finally:
        s.close()


def test_recv_timeout_before_read_fails_cleanly(cl):
    d = cl["d_short"]
    s = socket.socket()  # accepts, never answers: the handshake outlives recv_timeout_s
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": s.getsockname()[1],
                  "remote_block_ids": [0], "remote_request_id": "z", "remote_num_tokens": 3}  # fmt: skip
        d.call("needs", "slow", params)
        d.call("alloc", "slow", [1], 0, 3)
        kind, reason = d.wait_result("slow", timeout=5)
        assert kind == "failed" and "no handshake with" in reason and "within 0.5 s" in reason
    finally:
        s.close()


def test_unreachable_prefill_fails(cl):
    d = cl["d4"]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
              "remote_block_ids": [0], "remote_request_id": "z", "remote_num_tokens": 3}  # fmt: skip
    d.call("needs", "unreach", params)
    d.call("alloc", "unreach", [6], 0, 3)
    kind, reason = d.wait_result("unreach")
    assert kind == "failed" and "refused" in reason


def test_dead_prefill_fails_recv_not_crash(cl):
    p, d = cl["p_kill"], cl["d4"]
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
    before, after = pull_once(cl["p4"], d, "c", [0, 1], [4, 5], 0, 8)  # D keeps serving
    assert not np.array_equal(after, before)


def test_garbage_on_side_channel_does_not_hurt(cl):
    p, d = cl["p4"], cl["d4"]
    port = p.info["side_channel_port"]
    for junk in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xffxx", b"\x00\x00\x00\x02\x92\x01"):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(junk)
            s.settimeout(2)
            assert s.recv(100) == b""  # P closes the connection, no reply to garbage
    before, after = pull_once(p, d, "after-junk", [2, 3], [9, 10], 0, 8)
    assert not np.array_equal(after, before)


# ---- scrambled block order on the block-major cache ------------------------------------------------------------------
def test_pull_scrambled_blocks_exact_bytes(cl):
    """Scrambled ids with a few runs on each side, a one-block prefix hit and a partial last block."""
    p, d = cl["p4"], cl["d4"]
    p_blocks, d_blocks = [13, 2, 3, 9, 0, 1, 14, 7], [4, 5, 15, 11, 12, 6, 8, 10]
    p_kv = p.kv()
    before, after = pull_once(p, d, "s1", p_blocks, d_blocks, 4, 31)
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 4, 26))
    assert np.array_equal(after[d_blocks[0]], before[d_blocks[0]])  # the prefix hit's block is untouched


def test_pull_scrambled_blocks_different_block_sizes(cl):
    p, d = cl["p8"], cl["d4"]
    p_blocks, d_blocks = [5, 1, 6, 3], [14, 3, 9, 0, 7, 12, 1, 10]
    p_kv = p.kv()
    before, after = pull_once(p, d, "s2", p_blocks, d_blocks, 8, 30)
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 8, 21))


def test_refusal_releases_the_pin_at_once(cl):
    """Release on refusal: D refused the request before admitting it; P's pin goes now, not at its lease (30 s),
    and only a release naming exactly the pinned blocks frees it."""
    p, d = cl["p4"], cl["d4"]
    for i in range(3):  # the first handshakes, the later ones find it cached
        keep, params = p.call("finish", f"p-refused-{i}", [5, 6], 8, {"do_remote_decode": True})
        assert keep
        if i == 0:
            d.call("refuse", {**params, "remote_block_ids": [5, 7]})  # other blocks: not this pin
            time.sleep(0.3)
            assert p.count("finished_sends", f"p-refused-{i}") == 0
        d.call("refuse", params)
        p.wait_send(f"p-refused-{i}", timeout=5)
        assert p.count("finished_sends", f"p-refused-{i}") == 1
    assert p.call("stats")["transfers_expired"] == 0
