"""--kv-checksum over real NIXL between processes, both modes: the sums agree for intact transfers (different
block sizes, a prefix hit, host staging, two KV groups with a window), a byte flipped after landing fails the
recv before it is reported (counted in checksum_failures, P's blocks freed), and an instance without the
checksum is refused at the handshake naming both settings. TP is covered end to end
(tests/e2e/test_kv_checksum_e2e.py)."""

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults

FLIP = Faults(flip_kv_byte=True)
WINDOWS = (None, None, 8, 8)  # two KV groups (test_windowed.py): layers 0-1 full, layers 2-3 a window of 8
P_TABLES = [[5, 6, 9, 2, 0, 1], [-1, -1, -1, 3, 4, 7]]  # 22 tokens; the windowed group keeps blocks 3..
D_TABLES = [[3, 4, 11, 12, 13, 14], [-1, -1, -1, 8, 10, 15]]


@pytest.fixture(scope="module")
def cl():
    on = {"kv_checksum": True}
    insts = start_all(
        p_pull=Instance("prefill", "pull", block_size=4, **on),
        d_pull=Instance("decode", "pull", block_size=8, **on),
        d_pull_flip=Instance("decode", "pull", block_size=4, faults=FLIP, **on),
        d_pull_off=Instance("decode", "pull", block_size=4),
        p_push=Instance("prefill", "push", block_size=4, **on),
        d_push=Instance("decode", "push", block_size=4, faults=Faults(force_staging=True), **on),
        d_push_flip=Instance("decode", "push", block_size=8, faults=FLIP, **on),
        p_win=Instance("prefill", "pull", block_size=4, windows=WINDOWS, **on),
        d_win=Instance("decode", "pull", block_size=4, windows=WINDOWS, **on),
        d_win_flip=Instance("decode", "pull", block_size=4, windows=WINDOWS, faults=FLIP, **on),
    )
    yield insts
    close_all(insts)


def pull(p, d, rid, p_blocks, d_blocks, num_local, num_prompt, wait_p=True):
    _, params = p.call("finish", f"p-{rid}", p_blocks, num_prompt, {"do_remote_decode": True})
    assert d.call("needs", rid, params) is True
    d.call("alloc", rid, d_blocks, num_local, num_prompt)
    result = d.wait_result(rid)
    if wait_p:
        p.wait_send(f"p-{rid}")  # P's pin is freed, whatever D found
    return result


def push(p, d, tid, p_blocks, d_blocks, num_local, num_prompt):
    p_params, d_params = push_params(p, tid)
    assert d.call("needs", f"d-{tid}", d_params)
    d.call("alloc", f"d-{tid}", d_blocks, num_local, num_prompt)
    p.call("finish", f"p-{tid}", p_blocks, num_prompt, p_params)
    result = d.wait_result(f"d-{tid}")
    p.wait_send(f"p-{tid}")
    return result


def test_pull_intact_transfers_pass(cl):
    p, d = cl["p_pull"], cl["d_pull"]
    p_kv = p.kv()
    for i, (num_local, d_blocks) in enumerate([(0, [3, 4, 5]), (8, [9, 1, 2])]):  # the second: a prefix hit
        before = d.kv()
        assert pull(p, d, f"ok{i}", [5, 6, 9, 2, 7, 8], d_blocks, num_local, 22) == ("finished", None)
        assert np.array_equal(
            d.kv(), expected_kv(before, p_kv, d_blocks, [5, 6, 9, 2, 7, 8], num_local, 21 - num_local)
        )
    assert d.call("stats")["checksum_failures"] == 0


def test_pull_flipped_byte_fails_the_recv(cl):
    p, d = cl["p_pull"], cl["d_pull_flip"]
    for i in range(2):  # a second request on the same deployment fails alike
        kind, reason = pull(p, d, f"flip{i}", [5, 6, 9, 2], [3, 4, 11, 12], 0, 14)
        assert kind == "failed" and "KV checksum mismatch" in reason and "rank 0" in reason, reason
    assert d.call("stats")["checksum_failures"] == 2


def test_pull_checksum_off_on_one_side_is_refused(cl):
    # (P's pin is not released: D never handshook with it; the lease frees it)
    kind, reason = pull(cl["p_pull"], cl["d_pull_off"], "off", [5, 6, 9, 2], [3, 4, 11, 12], 0, 14, wait_p=False)
    assert kind == "failed" and "--kv-checksum is on on the peer, off on this instance" in reason, reason


def test_push_intact_transfers_pass(cl):
    p, d = cl["p_push"], cl["d_push"]
    p_kv = p.kv()
    for i, num_local in enumerate([0, 4]):
        before = d.kv()
        assert push(p, d, f"ok{i}", [5, 6, 9, 2], [3, 4, 11, 12], num_local, 14) == ("finished", None)
        want = expected_kv(before, p_kv, [3, 4, 11, 12], [5, 6, 9, 2], num_local, 13 - num_local, staged=True)
        assert np.array_equal(d.kv(), want)
    assert d.call("stats")["checksum_failures"] == 0


def test_push_flipped_byte_fails_the_recv(cl):
    p, d = cl["p_push"], cl["d_push_flip"]
    for i in range(2):
        kind, reason = push(p, d, f"flip{i}", [5, 6, 9, 2, 7, 8], [3, 4, 10], 0, 22)  # P blocks of 4, D of 8
        assert kind == "failed" and "KV checksum mismatch" in reason, reason
    assert d.call("stats")["checksum_failures"] == 2


@pytest.mark.parametrize(("d_name", "want"), [("d_win", "finished"), ("d_win_flip", "failed")])
def test_windowed_groups(cl, d_name, want):
    """Two KV groups, the windowed one moving only its window: intact passes, a flip fails."""
    p, d = cl["p_win"], cl[d_name]
    _, params = p.call("finish", f"p-{d_name}", P_TABLES[0], 22, {"do_remote_decode": True}, P_TABLES)
    assert d.call("needs", d_name, params) is True
    d.call("alloc", d_name, D_TABLES[0], 0, 22, D_TABLES)
    kind, reason = d.wait_result(d_name)
    assert kind == want, reason
    p.wait_send(f"p-{d_name}")
