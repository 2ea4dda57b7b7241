"""Push mode over real NIXL between processes: rendezvous in both orders, exact bytes, timeouts, cancels,
attempts, dead peers. Instances are shared by the module (starting one costs seconds); request and transfer
ids are unique per test."""

import time

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, events, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults

DELAY = 0.3  # the test-only fault delays


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p4=Instance("prefill", "push", block_size=4),
        d4=Instance("decode", "push", block_size=4),
        p8=Instance("prefill", "push", block_size=8, faults=Faults(delay_send_ready_s=DELAY)),  # registration first
        d8=Instance("decode", "push", block_size=8, faults=Faults(delay_register_s=DELAY)),  # prefill first
        p_short=Instance("prefill", "push", block_size=4, push_registration_timeout_s=0.3, lease_s=0.3),
        d_short=Instance("decode", "push", block_size=4, recv_timeout_s=0.5),
        p_q=Instance("prefill", "push", block_size=4, push_registration_timeout_s=0.5),
        p_pull=Instance("prefill", "pull", block_size=4),
    )
    yield insts
    close_all(insts)


def wait_event(inst, request_id, name, timeout=5.0):
    deadline = time.monotonic() + timeout
    while name not in events(inst, request_id):
        assert time.monotonic() < deadline, f"no {name} for {request_id} within {timeout} s"
        time.sleep(0.005)


def push_once(p, d, tid, p_blocks, d_blocks, num_local, num_prompt, d_first=True):
    """One request through both halves; returns (D's cache before, after, P's cache, time P finished)."""
    p_params, d_params = push_params(p, tid)
    before, p_kv = d.kv(), p.kv()
    if d_first:
        assert d.call("needs", f"d-{tid}", d_params)
        d.call("alloc", f"d-{tid}", d_blocks, num_local, num_prompt)
    t_finish = time.time()
    keep, resp = p.call("finish", f"p-{tid}", p_blocks, num_prompt, p_params)
    assert keep and resp["transfer_id"] == tid
    if not d_first:
        d.call("needs", f"d-{tid}", d_params)
        d.call("alloc", f"d-{tid}", d_blocks, num_local, num_prompt)
    kind, reason = d.wait_result(f"d-{tid}")
    assert kind == "finished", reason
    p.wait_send(f"p-{tid}")
    return before, d.kv(), p_kv, t_finish


def test_push_exact_bytes_and_nothing_else(cl):
    p, d = cl["p4"], cl["d4"]
    before, after, p_kv, _ = push_once(p, d, "t1", [5, 6, 9, 2], [3, 4, 11, 12], 0, 14)
    assert np.array_equal(after, expected_kv(before, p_kv, [3, 4, 11, 12], [5, 6, 9, 2], 0, 13))
    assert not np.array_equal(after, before)
    assert d.count("finished_recvs", "d-t1") == 1 and p.count("finished_sends", "p-t1") == 1


def test_push_prefix_hit_only_suffix_written(cl):
    p, d = cl["p4"], cl["d4"]
    before, after, p_kv, _ = push_once(p, d, "t2", [1, 2, 3], [7, 8, 13], 4, 11, d_first=False)
    assert np.array_equal(after, expected_kv(before, p_kv, [7, 8, 13], [1, 2, 3], 4, 6))


def test_zero_token_push_frees_both(cl):
    p, d = cl["p4"], cl["d4"]
    before, after, _, _ = push_once(p, d, "t3", [4, 5], [14, 15], 4, 5)
    assert np.array_equal(after, before)


def test_registration_first_forced(cl):
    p, d = cl["p8"], cl["d4"]  # P holds its finished prefill back DELAY s
    before, after, p_kv, t_finish = push_once(p, d, "t4", [0, 3, 5], [1, 2, 9, 10, 6], 4, 19)
    assert np.array_equal(after, expected_kv(before, p_kv, [1, 2, 9, 10, 6], [0, 3, 5], 4, 14))
    ev_p, ev_d = events(p, "p-t4"), events(d, "d-t4")
    assert ev_p["registration_received"] < t_finish + DELAY - 0.1 < ev_p["transfer_posted"]
    # (P may see its WRITE done after D has the completion: no order between transfer_done and kv_received)
    assert ev_d["registration_sent"] < ev_p["transfer_posted"] <= min(ev_p["transfer_done"], ev_d["kv_received"])


def test_prefill_first_forced(cl):
    p, d = cl["p4"], cl["d8"]  # D holds its registration back DELAY s
    before, after, p_kv, t_finish = push_once(p, d, "t5", [5, 6, 7, 1, 0], [9, 4, 3], 0, 20)
    assert np.array_equal(after, expected_kv(before, p_kv, [9, 4, 3], [5, 6, 7, 1, 0], 0, 19))
    ev_p, ev_d = events(p, "p-t5"), events(d, "d-t5")
    assert ev_d["registration_sent"] > t_finish + DELAY - 0.1
    assert ev_p["registration_received"] <= ev_p["transfer_posted"] <= ev_d["kv_received"]


def test_registration_timeout_fails_d_cleanly(cl):
    p, d = cl["p_short"], cl["d4"]
    _, d_params = push_params(p, "t6")
    d.call("needs", "d-t6", d_params)
    d.call("alloc", "d-t6", [0, 1], 0, 8)  # P never finishes this prefill
    kind, reason = d.wait_result("d-t6", timeout=5)
    assert kind == "failed" and "did not finish within 0.3 s" in reason


def test_lease_expiry_frees_unregistered_prefill(cl):
    p = cl["p_short"]
    p_params, _ = push_params(p, "t7")
    assert p.call("finish", "p-t7", [0, 1], 8, p_params)[0]
    p.wait_send("p-t7", timeout=5)
    assert p.call("stats")["transfers_expired"] >= 1


def test_recv_timeout_cancels_with_p_ack(cl):
    p, d = cl["p4"], cl["d_short"]
    p_params, d_params = push_params(p, "t8")
    d.call("needs", "d-t8", d_params)
    d.call("alloc", "d-t8", [0, 1], 0, 8)
    kind, reason = d.wait_result("d-t8", timeout=5)
    assert kind == "failed" and "did not arrive within 0.5 s" in reason
    assert "prefill_queued" not in events(d, "d-t8")  # P never heard of the prefill: no sign of life
    # the prefill finishing late writes nothing: the cancelled registration is gone, the blocks are safe
    before = d.kv()
    p.call("finish", "p-t8", [2, 3], 8, p_params)
    time.sleep(0.3)
    assert np.array_equal(d.kv(), before) and d.count("failed_recvs", "d-t8") == 1


def test_abort_after_registration_is_cancelled(cl):
    p, d = cl["p4"], cl["d4"]
    p_params, d_params = push_params(p, "t9")
    before = d.kv()
    d.call("needs", "d-t9", d_params)
    d.call("alloc", "d-t9", [0, 1], 0, 8)
    deadline = time.time() + 5
    while "registration_sent" not in events(d, "d-t9") and time.time() < deadline:
        time.sleep(0.01)
    d.call("abort", "d-t9")
    assert d.wait_result("d-t9") == ("cancelled", None)
    p.call("finish", "p-t9", [2, 3], 8, p_params)
    time.sleep(0.3)
    assert np.array_equal(d.kv(), before)


def test_abort_before_registration_is_cancelled_at_once(cl):
    p, d = cl["p4"], cl["d8"]  # the hook keeps the registration unsent for DELAY s
    _, d_params = push_params(p, "t10")
    d.call("needs", "d-t10", d_params)
    d.call("alloc", "d-t10", [0], 0, 8)
    d.call("abort", "d-t10")
    assert d.wait_result("d-t10") == ("cancelled", None)
    time.sleep(DELAY + 0.1)
    assert "registration_sent" not in events(d, "d-t10")


def test_new_attempt_gets_the_data_old_blocks_untouched(cl):
    p, d = cl["p4"], cl["d4"]
    p_params, d_params = push_params(p, "t11")
    d.call("needs", "d-t11a", d_params)
    d.call("alloc", "d-t11a", [0, 1], 0, 8)  # attempt 0
    d.call("abort", "d-t11a")
    assert d.wait_result("d-t11a") == ("cancelled", None)
    before, p_kv = d.kv(), p.kv()
    d.call("needs", "d-t11b", d_params)
    d.call("alloc", "d-t11b", [5, 6], 0, 8)  # attempt 1, other blocks
    p.call("finish", "p-t11", [8, 9], 8, p_params)
    assert d.wait_result("d-t11b") == ("finished", None)
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [5, 6], [8, 9], 0, 7))  # blocks 0, 1 untouched


def test_mixing_push_and_pull_is_refused(cl):
    p, d = cl["p_pull"], cl["d4"]
    _, d_params = push_params(p, "t12")
    d.call("needs", "d-t12", d_params)
    d.call("alloc", "d-t12", [0], 0, 3)
    kind, reason = d.wait_result("d-t12")
    assert kind == "failed" and "peer is in pull mode, this instance is in push mode" in reason


def test_push_stats(cl):
    s = cl["p4"].call("stats")
    assert s["sent_bytes"] > 0 and s["transfers_ok"] >= 3 and s["transfer_seconds"]
    assert cl["d4"].call("stats")["received_bytes"] > 0


def test_block_size_translation_d_smaller(cl):
    p, d = cl["p8"], cl["d4"]
    before, after, p_kv, _ = push_once(p, d, "t13", [2, 0, 7], [3, 9, 10, 1, 2, 6], 4, 22, d_first=False)
    assert np.array_equal(after, expected_kv(before, p_kv, [3, 9, 10, 1, 2, 6], [2, 0, 7], 4, 17))


def test_block_size_translation_d_larger(cl):
    p, d = cl["p4"], cl["d8"]
    before, after, p_kv, _ = push_once(p, d, "t14", [9, 3, 4, 5, 10, 11], [5, 2, 7], 8, 23)
    assert np.array_equal(after, expected_kv(before, p_kv, [5, 2, 7], [9, 3, 4, 5, 10, 11], 8, 14))


# ---- a prefill that queues on an overloaded P ------------------------------------------------------------------------
QUEUED_S = 3.0  # how long P's prefill takes here: 6x P's registration timeout, 6x D's receive timeout


def test_queued_prefill_outlives_both_timeouts(cl):
    """P works on the prefills for QUEUED_S while its registration timeout is 0.5 s and D's receive timeout
    0.5 s: PushQueued keeps both waiting, whether P's request or D's registration came first. A registration
    for a transfer P was never told about still times out meanwhile."""
    p, d = cl["p_q"], cl["d_short"]
    pa, da = push_params(p, "q1")  # P's request arrives first
    pb, db = push_params(p, "q2")  # D registers first: P does not know the transfer yet
    _, dc = push_params(p, "q3")  # P never gets this prefill
    assert not p.call("needs", "p-q1", pa)
    for rid, params, blocks in (("d-q1", da, [0, 1]), ("d-q2", db, [2, 3]), ("d-q3", dc, [4, 5])):
        assert d.call("needs", rid, params)
        d.call("alloc", rid, blocks, 0, 8)
    wait_event(d, "d-q2", "registration_sent")
    assert not p.call("needs", "p-q2", pb)
    kind, reason = d.wait_result("d-q3", timeout=5)  # D's receive timeout or P's registration timeout
    assert kind == "failed" and "within 0.5 s" in reason and "prefill_queued" not in events(d, "d-q3")
    time.sleep(QUEUED_S)
    r = d.results()
    assert not any(rid in ("d-q1", "d-q2") for rid in r["finished_recvs"] + r["cancelled_recvs"])
    assert not any(rid in ("d-q1", "d-q2") for rid, _ in r["failed_recvs"]), r["failed_recvs"]
    before, p_kv = d.kv(), p.kv()
    p.call("finish", "p-q1", [6, 7], 8, pa)
    p.call("finish", "p-q2", [9, 8], 8, pb)
    assert d.wait_result("d-q1") == ("finished", None) and d.wait_result("d-q2") == ("finished", None)
    want = expected_kv(expected_kv(before, p_kv, [0, 1], [6, 7], 0, 7), p_kv, [2, 3], [9, 8], 0, 7)
    assert np.array_equal(d.kv(), want)
    ev1, ev2 = events(d, "d-q1"), events(d, "d-q2")
    assert ev1["registration_sent"] <= ev1["prefill_queued"] < ev1["kv_received"] - QUEUED_S + 0.5
    assert ev2["registration_sent"] <= ev2["prefill_queued"]
    p.wait_send("p-q1")
    p.wait_send("p-q2")


def test_abandoned_prefill_fails_registration_at_once(cl):
    """P's request is aborted while D's registration waits for it: D's recv fails at once (not after a
    timeout: these instances have the default ones), and nothing lands in its blocks later."""
    p, d = cl["p4"], cl["d4"]
    pa, da = push_params(p, "q4")
    assert not p.call("needs", "p-q4", pa)
    d.call("needs", "d-q4", da)
    d.call("alloc", "d-q4", [0, 1], 0, 8)
    wait_event(d, "d-q4", "prefill_queued")  # P has the registration and knows it is working on the prefill
    started = time.monotonic()
    p.call("abort_request", "p-q4")
    kind, reason = d.wait_result("d-q4", timeout=15)
    assert kind == "failed" and "aborted on the prefill instance" in reason
    assert time.monotonic() - started < 10.0  # "at once": the default timeouts here are 30 / 60 s
    # D's blocks are safe: a late prefill for the transfer is refused, and the blocks take another transfer
    before = d.kv()
    p.call("finish", "p-q4-late", [2, 3], 8, pa)
    p.wait_send("p-q4-late")
    assert np.array_equal(d.kv(), before)
    before, after, p_kv, _ = push_once(p, d, "q5", [7, 8], [0, 1], 0, 8)
    assert np.array_equal(after, expected_kv(before, p_kv, [0, 1], [7, 8], 0, 7))


def test_registration_after_abandon_is_refused_at_once(cl):
    p, d = cl["p4"], cl["d4"]
    pa, da = push_params(p, "q6")
    p.call("needs", "p-q6", pa)
    p.call("abort_request", "p-q6")  # aborted while queued, before D registered
    started = time.monotonic()
    d.call("needs", "d-q6", da)
    d.call("alloc", "d-q6", [0, 1], 0, 8)
    kind, reason = d.wait_result("d-q6", timeout=15)
    assert kind == "failed" and "aborted on the prefill instance" in reason
    assert time.monotonic() - started < 10.0  # "at once": the default timeouts here are 30 / 60 s


# ---- dead peers (these kill shared instances: keep them last) ------------------------------------------------------
def test_dead_prefill_fails_recv_at_once(cl):
    p, d = cl["p_short"], cl["d_short"]
    p_params, d_params = push_params(p, "t15")
    p.call("needs", "p-t15", p_params)  # P is working on it: it keeps D waiting until it dies
    d.call("needs", "d-t15", d_params)
    d.call("alloc", "d-t15", [0, 1], 0, 8)
    wait_event(d, "d-t15", "prefill_queued")
    p.kill()
    killed = time.monotonic()
    kind, reason = d.wait_result("d-t15", timeout=10)
    assert kind == "failed" and "is gone" in reason  # the heartbeat noticed (side channel refused)
    assert time.monotonic() - killed < 3.0


def test_dead_decode_frees_prefill_blocks(cl):
    p, d = cl["p4"], cl["d_short"]
    p_params, d_params = push_params(p, "t16")
    d.call("needs", "d-t16", d_params)
    d.call("alloc", "d-t16", [0, 1], 0, 8)
    time.sleep(0.1)  # registered
    d.kill()
    p.call("finish", "p-t16", [0, 1], 8, p_params)
    p.wait_send("p-t16", timeout=10)  # the WRITE failed (or landed in a dead process): P's blocks are back
    # P keeps serving
    before, after, p_kv, _ = push_once(p, cl["d4"], "t17", [3], [3], 0, 4)
    assert np.array_equal(after, expected_kv(before, p_kv, [3], [3], 0, 3))


# ---- scrambled block order on the block-major cache ------------------------------------------------------------------
def test_push_scrambled_blocks_exact_bytes(cl):
    """Scrambled ids with a few runs on each side, a one-block prefix hit and a partial last block: every block
    whole on both sides moves as one range, the rest per layer and K/V; nothing outside the tokens changes."""
    p, d = cl["p4"], cl["d4"]
    p_blocks, d_blocks = [13, 2, 3, 9, 0, 1, 14, 7], [4, 5, 15, 11, 12, 6, 8, 10]
    before, after, p_kv, _ = push_once(p, d, "s1", p_blocks, d_blocks, 4, 31)
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 4, 26))
    assert np.array_equal(after[d_blocks[-1], :, :, 2:], before[d_blocks[-1], :, :, 2:])  # rows past the end


def test_push_scrambled_blocks_different_block_sizes(cl):
    p, d = cl["p8"], cl["d4"]
    p_blocks, d_blocks = [5, 1, 6, 3], [14, 3, 9, 0, 7, 12, 1, 10]
    before, after, p_kv, _ = push_once(p, d, "s2", p_blocks, d_blocks, 8, 30, d_first=False)
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 8, 21))


def test_refusal_frees_a_finished_prefill_at_once(cl):
    """Release on refusal: D refused the request before registering (PushCancel of attempt -1); P's finished
    prefill goes now, not at its lease (30 s), and a registration that comes later anyway is refused."""
    p, d = cl["p4"], cl["d4"]
    for i in range(2):
        p_params, d_params = push_params(p, f"t-ref1-{i}")
        assert p.call("finish", f"p-t-ref1-{i}", [0, 1], 8, p_params)[0]
        d.call("refuse", d_params)
        p.wait_send(f"p-t-ref1-{i}", timeout=5)
    d.call("needs", "d-t-ref1", d_params)
    d.call("alloc", "d-t-ref1", [0, 1], 0, 8)
    kind, reason = d.wait_result("d-t-ref1")
    assert kind == "failed" and "decode instance refused" in reason


def test_refusal_before_the_prefill_frees_it_when_handed_over(cl):
    """Both legs leave at once: the refusal may reach P before its request (unknown transfer) or while P computes
    it (expected); either way the prefill is freed as soon as it is handed over."""
    p, d = cl["p4"], cl["d4"]
    p_params, d_params = push_params(p, "t-ref2")
    d.call("refuse", d_params)
    time.sleep(0.2)  # the refusal lands first
    assert p.call("finish", "p-t-ref2", [0, 1], 8, p_params)[0]
    p.wait_send("p-t-ref2", timeout=5)
    p_params, d_params = push_params(p, "t-ref3")
    p.call("needs", "p-t-ref3", p_params)  # P's request arrived: queued or running
    d.call("refuse", d_params)
    time.sleep(0.2)
    assert p.call("finish", "p-t-ref3", [0, 1], 8, p_params)[0]
    p.wait_send("p-t-ref3", timeout=5)


def test_decode_giving_up_frees_the_prefill(cl):
    """A D that gives its registration up (aborted after or before registering) tells P, which frees the prefill
    as soon as it is handed over, unless a newer attempt registered meanwhile (test_new_attempt_...)."""
    p, d = cl["p4"], cl["d4"]
    p_params, d_params = push_params(p, "t-ref4")
    p.call("needs", "p-t-ref4", p_params)
    d.call("needs", "d-t-ref4", d_params)
    d.call("alloc", "d-t-ref4", [0, 1], 0, 8)
    wait_event(d, "d-t-ref4", "registration_sent")
    d.call("abort", "d-t-ref4")
    assert d.wait_result("d-t-ref4") == ("cancelled", None)
    assert p.call("finish", "p-t-ref4", [2, 3], 8, p_params)[0]
    p.wait_send("p-t-ref4", timeout=5)
    p, d = cl["p4"], cl["d8"]  # d8 holds its registration back DELAY s: aborted before registering
    p_params, d_params = push_params(p, "t-ref5")
    assert p.call("finish", "p-t-ref5", [0, 1], 8, p_params)[0]
    d.call("needs", "d-t-ref5", d_params)
    d.call("alloc", "d-t-ref5", [0], 0, 8)
    d.call("abort", "d-t-ref5")
    assert d.wait_result("d-t-ref5") == ("cancelled", None)
    p.wait_send("p-t-ref5", timeout=5)
