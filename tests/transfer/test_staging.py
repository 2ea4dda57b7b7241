"""kv_buffer_device "cpu" staging (pdserve/transfer/staging.py) over real NIXL between processes, on the CPU:
Faults(force_staging=True) gives each instance a host mirror that NIXL moves instead of the cache, so the
block-id copies both ways and their moment are exercised here. D delays its copy-in (a test fault) so the test
can see that the landed data sits in the mirror and D's cache is unchanged until the recv is finished."""

import time

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, events, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults
from pdserve.transfer.staging import token_blocks

DELAY_S = 1.0
STAGED = Faults(force_staging=True)
STAGED_SLOW_IN = Faults(force_staging=True, delay_stage_in_s=DELAY_S)


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p_pull=Instance("prefill", "pull", block_size=4, faults=STAGED),
        d_pull=Instance("decode", "pull", block_size=4, faults=STAGED_SLOW_IN),
        d_pull8=Instance("decode", "pull", block_size=8),  # not staged: reads P's mirror
        p_push=Instance("prefill", "push", block_size=4, faults=STAGED),
        d_push=Instance("decode", "push", block_size=8, faults=STAGED_SLOW_IN),
    )
    yield insts
    close_all(insts)


def wait_for(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.005)


def test_token_blocks():
    assert token_blocks([7, 3, 9], 4, 0, 9) == [(7, 0, 4), (3, 0, 4), (9, 0, 1)]
    assert token_blocks([7, 3, 9], 4, 6, 3) == [(3, 2, 4), (9, 0, 1)]
    assert token_blocks([7], 4, 0, 0) == []


def test_staged_pull_lands_in_mirror_until_finished(cl):
    p, d = cl["p_pull"], cl["d_pull"]
    p_kv = p.kv()
    p_blocks, d_blocks = [5, 6, 9, 2], [3, 4, 11, 12]
    keep, params = p.call("finish", "p-s1", p_blocks, 14, {"do_remote_decode": True})  # P staged before replying
    assert keep and d.call("needs", "s1", params)
    before = d.kv()
    d.call("alloc", "s1", d_blocks, 0, 14)
    wait_for(lambda: "transfer_done" in events(d, "s1"), "READ done")  # the data is in D's mirror
    mid = d.kv()
    assert "s1" not in d.results()["finished_recvs"]
    assert np.array_equal(mid, before), "D's cache changed before the recv finished"
    kind, reason = d.wait_result("s1")
    assert kind == "finished", reason
    after = d.kv()
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 0, 13, staged=True))  # exactly 13
    assert not np.array_equal(after, before)
    p.wait_send("p-s1")


def test_unstaged_d_reads_staged_p(cl):
    p, d = cl["p_pull"], cl["d_pull8"]
    p_kv = p.kv()
    p_blocks, d_blocks = [1, 10, 14, 15, 0], [6, 2, 9]
    keep, params = p.call("finish", "p-s2", p_blocks, 19, {"do_remote_decode": True})
    assert d.call("needs", "s2", params)
    before = d.kv()
    d.call("alloc", "s2", d_blocks, 8, 19)  # one prefix-hit block on D
    kind, reason = d.wait_result("s2")
    assert kind == "finished", reason
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, d_blocks, p_blocks, 8, 10))


def test_staged_push_lands_in_mirror_until_finished(cl):
    p, d = cl["p_push"], cl["d_push"]
    p_params, d_params = push_params(p, "ts1")
    p_kv, before = p.kv(), d.kv()
    p_blocks, d_blocks = [7, 8, 3, 1, 12], [5, 2, 4]
    assert d.call("needs", "d-ts1", d_params)
    d.call("alloc", "d-ts1", d_blocks, 8, 18)  # D has tokens 0-7; receives 8-16
    keep, _ = p.call("finish", "p-ts1", p_blocks, 18, p_params)
    assert keep
    p.wait_send("p-ts1")  # the WRITE is DONE: the data is in D's mirror
    mid = d.kv()
    assert "d-ts1" not in d.results()["finished_recvs"]
    assert np.array_equal(mid, before), "D's cache changed before the recv finished"
    kind, reason = d.wait_result("d-ts1")
    assert kind == "finished", reason
    after = d.kv()
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 8, 9, staged=True))
    assert not np.array_equal(after, before)
