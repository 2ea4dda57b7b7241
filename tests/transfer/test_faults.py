"""The fault suite (issue 12): every fault ends each request in the right bytes or a clear failure — never
wrong bytes reported as received — and every survivor lets go of its blocks (P: one finished send per pin;
D: exactly one recv result) within seconds. Connector pairs in real processes (pdserve/testing/transfer_pair.py),
faults through the test-only Faults object; instances are shared by the module, ids are unique per test."""

import os
import signal
import time

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults

TIMEOUT = 1.0  # peer_timeout_s of the faulted instances (heartbeat_s 0.25)
LIVE = dict(heartbeat_s=0.25, peer_timeout_s=TIMEOUT)
QUEUE_LEASE = 1.5  # d_qdrop's lease_s: the longest it waits for an ack held back by other READs
# D: acks 1.5 s late (past TIMEOUT), READs of "queue-slow" in flight for 2 s (as READs served in order are)
QUEUED_LATE_ACK = Faults(delay_notifs=("PullReleaseAck",), notif_delay_s=1.5, slow_reads=("queue-slow",), slow_read_s=2)
# D: acks never come, READs of "qdrop-slow" in flight for 3 s (past QUEUE_LEASE)
QUEUED_LOST_ACK = Faults(drop_notifs=("PullReleaseAck",), slow_reads=("qdrop-slow",), slow_read_s=3.0)


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p=Instance("prefill", "pull", **LIVE),
        d=Instance("decode", "pull", **LIVE),
        p_short=Instance("prefill", "pull", lease_s=0.3, **LIVE),  # a lease D's delayed READ outlives
        d_slow=Instance("decode", "pull", faults=Faults(delay_read_s=0.6), **LIVE),
        d_noack=Instance("decode", "pull", faults=Faults(drop_notifs=("PullReleaseAck",)), **LIVE),
        d_dup=Instance("decode", "pull", faults=Faults(duplicate_notifs=("PullReleaseAck",)), **LIVE),
        p_dup=Instance("prefill", "pull", faults=Faults(duplicate_notifs=("PullRelease",)), **LIVE),
        d_late=Instance("decode", "pull", faults=Faults(delay_notifs=("PullReleaseAck",), notif_delay_s=0.3), **LIVE),
        d_err=Instance("decode", "pull", faults=Faults(fail_posts=True), **LIVE),
        p_slowack=Instance("prefill", "pull", faults=Faults(delay_notifs=("PullRelease",), notif_delay_s=0.5), **LIVE),
        d_queue=Instance("decode", "pull", faults=QUEUED_LATE_ACK, **LIVE),
        d_qdrop=Instance("decode", "pull", lease_s=QUEUE_LEASE, faults=QUEUED_LOST_ACK, **LIVE),
        pp=Instance("prefill", "push", **LIVE),
        dp=Instance("decode", "push", **LIVE),
        pp_err=Instance("prefill", "push", faults=Faults(fail_posts=True), **LIVE),
        dp_dup=Instance("decode", "push", faults=Faults(duplicate_notifs=("PushDone", "PushQueued")), **LIVE),
        pp_slow=Instance("prefill", "push", faults=Faults(delay_send_ready_s=0.3), **LIVE),
        p_die=Instance("prefill", "pull", faults=Faults(drop_notifs=("PullRelease",)), **LIVE),
        pp_die=Instance("prefill", "push", **LIVE),
    )
    yield insts
    close_all(insts)


def pull(p, d, rid, p_blocks=(1, 2), d_blocks=(3, 4), num_prompt=8):
    """P finishes p-rid; D allocates and receives; returns (D's result, D's cache before, P's cache)."""
    keep, params = p.call("finish", f"p-{rid}", list(p_blocks), num_prompt, {"do_remote_decode": True})
    assert keep
    before, p_kv = d.kv(), p.kv()
    d.call("needs", rid, params)
    d.call("alloc", rid, list(d_blocks), 0, num_prompt)
    return d.wait_result(rid), before, p_kv


def assert_exact(d, before, p_kv, d_blocks=(3, 4), p_blocks=(1, 2), num_prompt=8):
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, list(d_blocks), list(p_blocks), 0, num_prompt - 1))


def assert_one_result(d, rid, p=None, p_rid=None):
    """D reported the recv exactly once; P (if given) handed its pin back exactly once."""
    r = d.results()
    n = r["finished_recvs"].count(rid) + sum(1 for x, _ in r["failed_recvs"] if x == rid)
    n += r["cancelled_recvs"].count(rid)
    assert n == 1, r
    if p is not None:
        p.wait_send(p_rid, timeout=5)
        assert p.count("finished_sends", p_rid) == 1


# ---- pull: the READ is used only once P confirms the pin held ----------------------------------------------------
def test_read_after_lease_expiry_is_never_used(cl):
    """D's READ is posted after P's lease ran out: P answers held=False and D fails the recv (the engine then
    fails or recomputes it by policy) instead of running on blocks P may have reused."""
    (kind, reason), _, _ = pull(cl["p_short"], cl["d_slow"], "lease1")
    assert kind == "failed" and "did not hold" in reason and "lease" in reason
    assert_one_result(cl["d_slow"], "lease1", cl["p_short"], "p-lease1")
    assert cl["p_short"].call("stats")["transfers_expired"] >= 1


def test_pin_released_by_p_before_the_read_is_never_used(cl):
    """An abort on P (or the router's /kv_transfer/release) while D reads: D's READ is not confirmed."""
    p, d = cl["p"], cl["d_slow"]
    keep, params = p.call("finish", "p-rel1", [5, 6], 8, {"do_remote_decode": True})
    d.call("needs", "rel1", params)
    d.call("alloc", "rel1", [5, 6], 0, 8)
    p.call("release", "p-rel1")
    p.wait_send("p-rel1", timeout=1)  # freed at once, not after the lease
    kind, reason = d.wait_result("rel1")
    assert kind == "failed" and "released the pin" in reason


def test_dropped_ack_fails_within_the_deadline(cl):
    p, d = cl["p"], cl["d_noack"]
    started = time.monotonic()
    (kind, reason), _, _ = pull(p, d, "drop1")
    assert kind == "failed" and "did not confirm" in reason
    assert time.monotonic() - started < TIMEOUT + 2
    assert_one_result(d, "drop1", p, "p-drop1")  # the release did arrive: P freed its pin


def test_duplicated_release_and_ack_count_once(cl):
    for p, d, rid in ((cl["p_dup"], cl["d"], "dup1"), (cl["p"], cl["d_dup"], "dup2")):
        (kind, reason), before, p_kv = pull(p, d, rid)
        assert kind == "finished", reason
        assert_exact(d, before, p_kv)
        assert_one_result(d, rid, p, f"p-{rid}")


def test_delayed_ack_still_lands_exact_bytes(cl):
    (kind, reason), before, p_kv = pull(cl["p"], cl["d_late"], "late1")
    assert kind == "finished", reason
    assert_exact(cl["d_late"], before, p_kv)
    assert_one_result(cl["d_late"], "late1", cl["p"], "p-late1")


def start_pull(p, d, rid, p_blocks, d_blocks, num_prompt=8):
    """P finishes p-rid, D starts receiving rid; returns P's cache."""
    keep, params = p.call("finish", f"p-{rid}", list(p_blocks), num_prompt, {"do_remote_decode": True})
    assert keep
    d.call("needs", rid, params)
    d.call("alloc", rid, list(d_blocks), 0, num_prompt)


def test_ack_queued_behind_another_read_still_lands(cl):
    """P's ack comes 1.5 s after the release (past peer_timeout_s) while another request's READ from the same P
    is in flight on D (2 s, as READs served in order by an emulated GET are): P's answer is held back by that
    READ, not lost, so D waits for it and runs on exact bytes. The slow READ's own ack is as late with nothing
    in flight after it: that one still fails at peer_timeout_s. Each pin and each recv ends exactly once."""
    p, d = cl["p"], cl["d_queue"]
    before, p_kv = d.kv(), p.kv()
    started = time.monotonic()
    start_pull(p, d, "queue-slow", (9, 10), (13, 14))
    start_pull(p, d, "queue-fast", (11, 12), (1, 2))
    kind, reason = d.wait_result("queue-fast")
    assert kind == "finished", reason
    assert 1.4 < time.monotonic() - started < 2.5  # its ack's delay: past the plain deadline, before the slow READ
    after = d.kv()
    assert np.array_equal(after[[1, 2]], expected_kv(before, p_kv, [1, 2], [11, 12], 0, 7)[[1, 2]])
    kind, reason = d.wait_result("queue-slow")
    assert kind == "failed" and "did not confirm" in reason and f"within {TIMEOUT:g} s" in reason, reason
    assert 2.0 + TIMEOUT - 0.1 < time.monotonic() - started < 2.0 + 1.5  # before its late ack came
    for rid in ("queue-fast", "queue-slow"):
        assert_one_result(d, rid, p, f"p-{rid}")  # the releases arrived: P freed both pins


def test_ack_that_never_comes_behind_other_reads_fails_at_the_lease(cl):
    """The ack is lost while another READ from the same P stays in flight past P's lease: D waits at most until
    P would have freed the pin anyway, then fails; the slow READ, once over, gets the plain peer_timeout_s."""
    p, d = cl["p"], cl["d_qdrop"]
    started = time.monotonic()
    start_pull(p, d, "qdrop-slow", (13, 14), (5, 6))
    start_pull(p, d, "qdrop-fast", (15, 0), (7, 8))
    kind, reason = d.wait_result("qdrop-fast")
    assert kind == "failed" and "did not confirm" in reason and "lease ran out" in reason, reason
    assert QUEUE_LEASE - 0.1 < time.monotonic() - started < QUEUE_LEASE + 1.0
    kind, reason = d.wait_result("qdrop-slow")
    assert kind == "failed" and "did not confirm" in reason and f"within {TIMEOUT:g} s" in reason, reason
    assert 3.0 + TIMEOUT - 0.1 < time.monotonic() - started < 3.0 + TIMEOUT + 1.0
    for rid in ("qdrop-fast", "qdrop-slow"):
        assert_one_result(d, rid, p, f"p-{rid}")


def test_starved_d_neither_declares_p_dead_nor_drops_its_ack(cl):
    """D gets no CPU (SIGSTOP) for twice peer_timeout_s while it waits for P's ack, which P sends meanwhile: on
    waking D reads it before judging the deadline, and does not count its own stall as P's silence."""
    p, d = cl["p_slowack"], cl["d"]
    before, p_kv = d.kv(), p.kv()
    start_pull(p, d, "stall1", (1, 2), (13, 14))
    time.sleep(0.2)  # READ done, release sent; P answers it 0.5 s after it arrives
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2 * TIMEOUT)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    kind, reason = d.wait_result("stall1")
    assert kind == "finished", reason
    assert_exact(d, before, p_kv, d_blocks=(13, 14))
    assert_one_result(d, "stall1", p, "p-stall1")


def test_nixl_read_error_fails_cleanly_and_frees_p(cl):
    (kind, reason), before, _ = pull(cl["p"], cl["d_err"], "err1")
    assert kind == "failed" and "test fault" in reason
    assert np.array_equal(cl["d_err"].kv(), before)  # nothing landed
    assert_one_result(cl["d_err"], "err1", cl["p"], "p-err1")


def test_request_id_reuse_never_leaks_or_frees_the_other(cl):
    """A second pin under an id that is pinned already is refused (freed at once); the first stays intact and
    its own release frees it."""
    p, d = cl["p"], cl["d"]
    keep, params = p.call("finish", "p-reuse", [7, 8], 8, {"do_remote_decode": True})
    p.call("finish", "p-reuse", [9, 10], 8, {"do_remote_decode": True})
    p.wait_send("p-reuse", timeout=2)  # the second, refused
    p_kv, before = p.kv(), d.kv()
    d.call("needs", "reuse", params)
    d.call("alloc", "reuse", [9, 10], 0, 8)
    kind, reason = d.wait_result("reuse")
    assert kind == "finished", reason
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [9, 10], [7, 8], 0, 7))
    deadline = time.monotonic() + 2
    while p.count("finished_sends", "p-reuse") < 2:  # the first pin, by D's release
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ---- push ----------------------------------------------------------------------------------------------------------
def push(p, d, tid, d_blocks=(1, 2), num_prompt=8, tp_size=None, abort_after_register=False):
    p_params, d_params = push_params(p, tid)
    if tp_size is not None:
        d_params["tp_size"] = tp_size
    before, p_kv = d.kv(), p.kv()
    d.call("needs", f"d-{tid}", d_params)
    d.call("alloc", f"d-{tid}", list(d_blocks), 0, num_prompt)
    if abort_after_register:
        time.sleep(0.1)
        d.call("abort", f"d-{tid}")
    p.call("finish", f"p-{tid}", [3, 4], num_prompt, p_params)
    return d.wait_result(f"d-{tid}"), before, p_kv


def test_push_producer_count_comes_from_the_handshake(cl):
    """The request's tp_size is not what D counts (P's handshake is): 2 used to hang for ever; 0 and -1 (which
    used to report success unwritten) are refused at the edge."""
    (kind, reason), before, p_kv = push(cl["pp"], cl["dp"], "tp2", tp_size=2)
    assert kind == "finished", reason
    assert np.array_equal(cl["dp"].kv(), expected_kv(before, p_kv, [1, 2], [3, 4], 0, 7))
    assert_one_result(cl["dp"], "d-tp2", cl["pp"], "p-tp2")
    for bad in (0, -1):
        _, d_params = push_params(cl["pp"], "tp-bad")
        with pytest.raises(ValueError, match="tp_size"):
            cl["dp"].call("needs", "d-tp-bad", dict(d_params, tp_size=bad))


def test_push_duplicated_done_counts_once(cl):
    (kind, reason), before, p_kv = push(cl["pp"], cl["dp_dup"], "pdup")
    assert kind == "finished", reason
    assert np.array_equal(cl["dp_dup"].kv(), expected_kv(before, p_kv, [1, 2], [3, 4], 0, 7))
    assert_one_result(cl["dp_dup"], "d-pdup", cl["pp"], "p-pdup")


def test_push_write_error_fails_d_and_frees_both(cl):
    (kind, reason), before, _ = push(cl["pp_err"], cl["dp"], "perr", d_blocks=(5, 6))
    assert kind == "failed" and "test fault" in reason
    assert np.array_equal(cl["dp"].kv(), before)
    assert_one_result(cl["dp"], "d-perr", cl["pp_err"], "p-perr")


def test_push_no_write_after_d_cancelled(cl):
    """D aborts after registering, before P's prefill is ready: the WRITE never comes; D's blocks untouched."""
    (kind, _), before, _ = push(cl["pp_slow"], cl["dp"], "pcan", d_blocks=(7, 8), abort_after_register=True)
    assert kind == "cancelled"
    time.sleep(0.5)  # P's prefill reached the rendezvous: no registration, so no WRITE
    cl["pp_slow"].call("release", "p-pcan")  # the router, told D's leg ended, frees P's pin at once
    cl["pp_slow"].wait_send("p-pcan", timeout=1)
    assert np.array_equal(cl["dp"].kv()[[7, 8]], before[[7, 8]])
    assert_one_result(cl["dp"], "d-pcan")


def test_push_release_on_p_fails_d_at_once(cl):
    p, d = cl["pp_slow"], cl["dp"]
    p_params, d_params = push_params(p, "prel")
    p.call("finish", "p-prel", [3, 4], 8, p_params)  # handed over after 0.3 s (the fault)
    time.sleep(0.4)
    p.call("release", "p-prel")
    p.wait_send("p-prel", timeout=1)
    d.call("needs", "d-prel", d_params)
    d.call("alloc", "d-prel", [9, 10], 0, 8)
    kind, reason = d.wait_result("d-prel", timeout=3)
    assert kind == "failed" and "released" in reason


# ---- kill -9 at each protocol step (these kill instances: keep them last) ------------------------------------------
def test_kill_p_while_d_waits_for_the_ack(cl):
    """P dies after D's READ, before it answers (it drops releases): D fails at once, not after a timeout."""
    p, d = cl["p_die"], cl["d"]
    keep, params = p.call("finish", "p-kill1", [1, 2], 8, {"do_remote_decode": True})
    d.call("needs", "kill1", params)
    d.call("alloc", "kill1", [11, 12], 0, 8)
    time.sleep(0.2)  # READ done, waiting for the ack
    p.kill()
    kind, reason = d.wait_result("kill1", timeout=TIMEOUT + 2)
    assert kind == "failed"
    (kind, reason), before, p_kv = pull(cl["p"], d, "kill1b")  # D keeps serving
    assert kind == "finished", reason


def test_kill_p_after_registration_fails_d_within_seconds(cl):
    p, d = cl["pp_die"], cl["dp"]
    p_params, d_params = push_params(p, "pkill")
    p.call("needs", "p-pkill", p_params)  # P is working on it: D waits (keepalives) until P dies
    d.call("needs", "d-pkill", d_params)
    d.call("alloc", "d-pkill", [13, 14], 0, 8)
    time.sleep(0.3)
    p.kill()
    killed = time.monotonic()
    kind, reason = d.wait_result("d-pkill", timeout=TIMEOUT + 3)
    assert kind == "failed" and "gone" in reason
    assert time.monotonic() - killed < TIMEOUT + 1


def test_kill_d_before_reading_p_released_by_the_router(cl):
    """D dies before it reads: the router's POST /kv_transfer/release (here: the engine's release) frees P's
    pin at once instead of after the lease."""
    p, d = cl["p"], cl["d_err"]
    keep, _ = p.call("finish", "p-kill3", [13, 14], 8, {"do_remote_decode": True})
    d.kill()
    p.call("release", "p-kill3")
    p.wait_send("p-kill3", timeout=1)
    assert p.count("finished_sends", "p-kill3") == 1
