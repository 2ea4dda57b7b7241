"""Sliding-window KV groups over real NIXL between processes, pull and push: a two-group cache (layers 0-1 full
attention, layers 2-3 a window of 8; two layers per block) moves every token of the full group and only the
window's blocks of the windowed group; every other byte of D's cache is untouched. Instances are shared by the
module."""

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults

WINDOWS = (None, None, 8, 8)  # per model layer: group 0 = layers 0-1 (full), group 1 = layers 2-3 (window 8)
BS = 4
STALE = -1
# P holds 22 tokens; D computes the last prompt token itself, so 21 move. The windowed group's next query (position
# 21) reads keys 14..21: blocks from (21 - 8 + 1) // 4 = 3 on, so it moves tokens [12, 21) and P keeps (and D
# allocates) only blocks 3.. of it.
N_PROMPT, N_MOVED, W_FIRST = 22, 21, 12
P_TABLES = [[5, 6, 9, 2, 0, 1], [STALE, STALE, STALE, 3, 4, 7]]
D_TABLES = [[3, 4, 11, 12, 13, 14], [STALE, STALE, STALE, 8, 10, 15]]
STAGED = Faults(force_staging=True)
TOKEN_ROW_BYTES = 2 * 2 * 2 * 4 * 4  # 2 layers x K/V x 2 heads x 4 dims x float32, per token
N_SENT = 24 + 24 - W_FIRST  # tokens on the wire: each group's last block (21 of 24 tokens) moves whole


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p_pull=Instance("prefill", "pull", block_size=BS, windows=WINDOWS),
        d_pull=Instance("decode", "pull", block_size=BS, windows=WINDOWS),
        p_push=Instance("prefill", "push", block_size=BS, windows=WINDOWS),
        d_push=Instance("decode", "push", block_size=BS, windows=WINDOWS),
        d_full=Instance("decode", "pull", block_size=BS, windows=(None, None)),  # one full group, 2 layers a block
        # staged through host mirrors (kv_buffer_device cpu): the copies go per group too
        p_pull_staged=Instance("prefill", "pull", block_size=BS, windows=WINDOWS, faults=STAGED),
        d_pull_staged=Instance("decode", "pull", block_size=BS, windows=WINDOWS, faults=STAGED),
        p_push_staged=Instance("prefill", "push", block_size=BS, windows=WINDOWS, faults=STAGED),
        d_push_staged=Instance("decode", "push", block_size=BS, windows=WINDOWS, faults=STAGED),
    )
    yield insts
    close_all(insts)


def expected(before, p_kv, staged=False):
    """Group 0: tokens [0, 21) from P's group-0 blocks; group 1: tokens [12, 21) only (each group's last block
    whole unless D is staged: layout.pad_last_blocks)."""
    out = expected_kv(before, p_kv, D_TABLES[0], P_TABLES[0], 0, N_MOVED, staged)
    return expected_kv(out, p_kv, D_TABLES[1], P_TABLES[1], W_FIRST, N_MOVED - W_FIRST, staged)


def test_info_carries_the_groups(cl):
    assert cl["p_pull"].info["kv_groups"] == [{"window": None, "layers": [0, 1]}, {"window": 8, "layers": [2, 3]}]
    assert cl["d_full"].info["kv_groups"] == [{"window": None, "layers": [0, 1]}]


@pytest.mark.parametrize("staged", ["", "_staged"])
def test_pull_moves_only_the_window(cl, staged):
    p, d = cl[f"p_pull{staged}"], cl[f"d_pull{staged}"]
    p_kv, received = p.kv(), d.call("stats")["received_bytes"]
    keep, params = p.call("finish", "p-w1", P_TABLES[0], N_PROMPT, {"do_remote_decode": True}, P_TABLES)
    assert keep and params["remote_block_tables"] == P_TABLES
    assert params["remote_block_ids"] == [5, 6, 9, 2, 0, 1, 3, 4, 7]  # the pin: every group's live blocks
    assert d.call("needs", "w1", params) is True
    before = d.kv()
    d.call("alloc", "w1", D_TABLES[0], 0, N_PROMPT, D_TABLES)
    kind, reason = d.wait_result("w1")
    assert kind == "finished", reason
    p.wait_send("p-w1")  # the release named the pin's blocks exactly
    after = d.kv()
    assert np.array_equal(after, expected(before, p_kv, staged == "_staged"))
    assert np.array_equal(after[[8, 10]], p_kv[[3, 4]])  # whole window blocks
    assert (after[[0, 1, 2, 5, 6, 7, 9]] == -1).all()  # blocks no table names (STALE ones included) untouched
    assert d.call("stats")["received_bytes"] - received == N_SENT * TOKEN_ROW_BYTES


@pytest.mark.parametrize("staged", ["", "_staged"])
def test_push_moves_only_the_window(cl, staged):
    p, d = cl[f"p_push{staged}"], cl[f"d_push{staged}"]
    p_params, d_params = push_params(p, "tw1")
    p_kv, before, sent = p.kv(), d.kv(), p.call("stats")["sent_bytes"]
    assert d.call("needs", "d-tw1", d_params)
    d.call("alloc", "d-tw1", D_TABLES[0], 0, N_PROMPT, D_TABLES)
    keep, resp = p.call("finish", "p-tw1", P_TABLES[0], N_PROMPT, p_params, P_TABLES)
    assert keep and resp["transfer_id"] == "tw1"
    kind, reason = d.wait_result("d-tw1")
    assert kind == "finished", reason
    p.wait_send("p-tw1")
    assert np.array_equal(d.kv(), expected(before, p_kv, staged == "_staged"))
    assert p.call("stats")["sent_bytes"] - sent == N_SENT * TOKEN_ROW_BYTES


def test_prefix_hit_in_the_window_moves_only_the_rest(cl):
    p, d = cl["p_pull"], cl["d_pull"]
    p_kv = p.kv()
    keep, params = p.call("finish", "p-w2", P_TABLES[0], N_PROMPT, {"do_remote_decode": True}, P_TABLES)
    assert d.call("needs", "w2", params) is True
    before = d.kv()
    d.call("alloc", "w2", D_TABLES[0], 16, N_PROMPT, D_TABLES)  # D has tokens [0, 16) of both groups' tables
    kind, reason = d.wait_result("w2")
    assert kind == "finished", reason
    p.wait_send("p-w2")
    out = expected_kv(before, p_kv, D_TABLES[0], P_TABLES[0], 16, N_MOVED - 16)
    assert np.array_equal(d.kv(), expected_kv(out, p_kv, D_TABLES[1], P_TABLES[1], 16, N_MOVED - 16))


def test_disagreeing_groups_are_refused_naming_both(cl):
    p, d = cl["p_pull"], cl["d_full"]
    keep, params = p.call("finish", "p-d_full", P_TABLES[0], N_PROMPT, {"do_remote_decode": True}, P_TABLES)
    assert d.call("needs", "d_full", params) is True
    d.call("alloc", "d_full", [0, 1, 2, 3, 4, 5], 0, N_PROMPT)
    kind, reason = d.wait_result("d_full")
    words = "KV groups: peer has [full layers [0, 1], window 8 layers [2, 3]], this instance has [full layers [0, 1]]"
    assert kind == "failed" and words in reason, reason
