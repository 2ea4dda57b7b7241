"""Push: P lays a WRITE out before its prefill ends (thread/push_prepare.py), over real NIXL between processes.

P learns its blocks when the prompt's last chunk is scheduled ("scheduled", ConnectorScheduler.on_prefill_scheduled)
and D's rank its registration; whichever comes second prepares the WRITE, and the prefill's end only posts it. Each
case checks the bytes D got and P's count of prepared WRITEs (TransferStats.prepared_writes), which must be back
to 0 however the transfer ended: posted, abandoned, cancelled, superseded, or laid out again because P's blocks
changed; and a windowed group, staged and checksummed. Only NIXL's stale-handle refusal of a prepared WRITE
(StaleRequest, made real here with two agents in this process) is posted again from its rows: any other failure of
the post fails the transfer. Two P/D pairs and a P whose prepared posts fail serve the module; ids are unique per
test."""

import time

import numpy as np
import pytest

from pdserve.kv.geometry import CacheGeometry
from pdserve.testing.transfer_pair import Instance, close_all, events, expected_kv, push_params, start_all
from pdserve.transfer.base import KVCacheSpec
from pdserve.transfer.faults import Faults
from pdserve.transfer.thread.agent import AgentError, NixlAgent, StaleRequest, XferState

# a windowed, staged, checksummed pair (test_windowed.py's geometry): layers 0-1 full attention, 2-3 a window of 8
WINDOWS, STALE = (None, None, 8, 8), -1
WIDE = dict(block_size=4, windows=WINDOWS, faults=Faults(force_staging=True), kv_checksum=True)


@pytest.fixture(scope="module")
def cl():
    insts = start_all(
        p=Instance("prefill", "push", block_size=4),
        d=Instance("decode", "push", block_size=4),
        p_win=Instance("prefill", "push", **WIDE),
        d_win=Instance("decode", "push", **WIDE),
        p_bad=Instance("prefill", "push", block_size=4, faults=Faults(fail_prepared_posts=True)),
    )
    yield insts
    close_all(insts)


def wait_for(what, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.005)


def prepared(p):
    return p.call("stats")["prepared_writes"]


def register(d, tid, d_params, blocks, num_prompt):
    d.call("needs", f"d-{tid}", d_params)
    d.call("alloc", f"d-{tid}", blocks, 0, num_prompt)


def test_prepared_when_registered_then_posted_at_the_prefill_end(cl):
    """P's blocks known first, D registers: prepared then; the prefill's end posts it (not laid out again)."""
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a1")
    p.call("needs", "p-a1", pa)
    p.call("scheduled", "p-a1", [5, 6, 9], 11, pa)
    before, p_kv = d.kv(), p.kv()
    register(d, "a1", da, [3, 4, 11], 11)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a1"))
    assert prepared(p) == 1
    p.call("finish", "p-a1", [5, 6, 9], 11, pa)
    assert d.wait_result("d-a1") == ("finished", None)
    p.wait_send("p-a1")
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [3, 4, 11], [5, 6, 9], 0, 10))
    ev = events(p, "p-a1")
    assert "write_segments" not in ev and ev["write_prepared"] < ev["send_taken"] <= ev["transfer_posted"]
    assert prepared(p) == 0


def test_prepared_when_scheduled_after_the_registration(cl):
    """D registers first (P's request queued), then P schedules the prompt's last chunk: prepared then."""
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a2")
    p.call("needs", "p-a2", pa)
    before, p_kv = d.kv(), p.kv()
    register(d, "a2", da, [7, 8], 8)
    wait_for("prefill_queued", lambda: "prefill_queued" in events(d, "d-a2"))  # P holds the registration
    p.call("scheduled", "p-a2", [1, 2], 8, pa)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a2"))
    p.call("finish", "p-a2", [1, 2], 8, pa)
    assert d.wait_result("d-a2") == ("finished", None)
    p.wait_send("p-a2")
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [7, 8], [1, 2], 0, 7))
    assert "write_segments" not in events(p, "p-a2") and prepared(p) == 0


def test_changed_blocks_are_laid_out_again(cl):
    """The finished prefill names other blocks than the scheduled chunk did: the WRITE reads the finished
    prefill's (a prepared WRITE posted as it was would copy blocks 0 and 1)."""
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a3")
    p.call("needs", "p-a3", pa)
    p.call("scheduled", "p-a3", [0, 1], 8, pa)
    before, p_kv = d.kv(), p.kv()
    register(d, "a3", da, [12, 13], 8)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a3"))
    p.call("finish", "p-a3", [0, 10], 8, pa)
    assert d.wait_result("d-a3") == ("finished", None)
    p.wait_send("p-a3")
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [12, 13], [0, 10], 0, 7))
    assert "write_segments" in events(p, "p-a3") and prepared(p) == 0


def test_abandoned_prefill_frees_its_prepared_write(cl):
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a4")
    p.call("needs", "p-a4", pa)
    p.call("scheduled", "p-a4", [2, 3], 8, pa)
    before = d.kv()
    register(d, "a4", da, [0, 1], 8)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a4"))
    assert prepared(p) == 1
    p.call("abort_request", "p-a4")
    kind, reason = d.wait_result("d-a4")
    assert kind == "failed" and "aborted on the prefill instance" in reason
    wait_for("prepared_writes == 0", lambda: prepared(p) == 0)
    assert np.array_equal(d.kv(), before)


def test_cancelled_then_newer_attempt_gets_a_fresh_write(cl):
    """D's attempt 0 is prepared, then cancelled (its blocks must stay untouched); attempt 1 registers other
    blocks, is prepared in turn, and gets the data. Nothing stays prepared."""
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a5")
    p.call("needs", "p-a5", pa)
    p.call("scheduled", "p-a5", [4, 5], 8, pa)
    register(d, "a5a", da, [0, 1], 8)
    wait_for("first write_prepared", lambda: "write_prepared" in events(p, "p-a5"))
    d.call("abort", "d-a5a")
    assert d.wait_result("d-a5a") == ("cancelled", None)
    wait_for("prepared_writes == 0", lambda: prepared(p) == 0)
    before, p_kv = d.kv(), p.kv()
    register(d, "a5b", da, [14, 15], 8)
    wait_for("second write_prepared", lambda: prepared(p) == 1)
    p.call("finish", "p-a5", [4, 5], 8, pa)
    assert d.wait_result("d-a5b") == ("finished", None)
    p.wait_send("p-a5")
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [14, 15], [4, 5], 0, 7))  # blocks 0, 1 untouched
    assert prepared(p) == 0


def test_registration_after_the_prefill_ended_is_laid_out_then(cl):
    p, d = cl["p"], cl["d"]
    pa, da = push_params(p, "a6")
    p.call("needs", "p-a6", pa)
    p.call("scheduled", "p-a6", [8, 9], 8, pa)
    before, p_kv = d.kv(), p.kv()
    p.call("finish", "p-a6", [8, 9], 8, pa)
    register(d, "a6", da, [10, 11], 8)
    assert d.wait_result("d-a6") == ("finished", None)
    p.wait_send("p-a6")
    assert np.array_equal(d.kv(), expected_kv(before, p_kv, [10, 11], [8, 9], 0, 7))
    ev = events(p, "p-a6")
    assert "write_prepared" not in ev and "write_segments" in ev and prepared(p) == 0


def test_windowed_staged_checksummed_prepared_write(cl):
    """A windowed group's blocks before the window turn STALE between the scheduled chunk and the prefill's end
    (the engine frees them after the step): the prepared WRITE still fits (it reads only the window's blocks), is
    staged through the host mirror at the post and carries the checksum D verifies. 22 prompt tokens, D computes
    the last one: 21 move, the windowed group's from token 12 (block 3) on."""
    p, d = cl["p_win"], cl["d_win"]
    pa, da = push_params(p, "a7")
    scheduled = [[5, 6, 9, 2, 0, 1], [11, 12, 13, 3, 4, 7]]
    finished = [[5, 6, 9, 2, 0, 1], [STALE, STALE, STALE, 3, 4, 7]]
    d_tables = [[3, 4, 11, 12, 13, 14], [STALE, STALE, STALE, 8, 10, 15]]
    p.call("needs", "p-a7", pa)
    p.call("scheduled", "p-a7", scheduled[0], 22, pa, scheduled)
    before, p_kv = d.kv(), p.kv()
    d.call("needs", "d-a7", da)
    d.call("alloc", "d-a7", d_tables[0], 0, 22, d_tables)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a7"))
    p.call("finish", "p-a7", finished[0], 22, pa, finished)
    kind, reason = d.wait_result("d-a7")
    assert kind == "finished", reason  # (a checksum mismatch fails the recv)
    p.wait_send("p-a7")
    want = expected_kv(before, p_kv, d_tables[0], finished[0], 0, 21, staged=True)
    want = expected_kv(want, p_kv, d_tables[1], finished[1], 12, 9, staged=True)
    assert np.array_equal(d.kv(), want)
    assert "write_segments" not in events(p, "p-a7") and prepared(p) == 0
    assert d.call("stats")["checksum_failures"] == 0


def test_other_failures_of_a_prepared_post_fail_the_transfer(cl):
    """A prepared WRITE whose post fails otherwise than as a stale handle (here: Faults.fail_prepared_posts) is not
    posted again from its rows: D's recv fails, its blocks untouched, and nothing stays prepared."""
    p, d = cl["p_bad"], cl["d"]
    pa, da = push_params(p, "a8")
    p.call("needs", "p-a8", pa)
    p.call("scheduled", "p-a8", [5, 6], 8, pa)
    before = d.kv()
    register(d, "a8", da, [2, 3], 8)
    wait_for("write_prepared", lambda: "write_prepared" in events(p, "p-a8"))
    p.call("finish", "p-a8", [5, 6], 8, pa)
    kind, reason = d.wait_result("d-a8")
    assert kind == "failed", reason
    assert "transfer_posted" not in events(p, "p-a8")
    wait_for("prepared_writes == 0", lambda: prepared(p) == 0)
    assert np.array_equal(d.kv(), before)


def _agent(name: str) -> tuple[NixlAgent, np.ndarray]:
    geometry = CacheGeometry.of((), 1, 1, 16, 1, 4, 4)  # 4 blocks of 4 tokens, 16 bytes per token
    buf = np.arange(geometry.total_bytes, dtype=np.uint8) if name == "src" else np.zeros(geometry.total_bytes, np.uint8)
    return NixlAgent(name, buf, KVCacheSpec(geometry, buf.ctypes.data, "DRAM", 0, "m", "uint8")), buf


def test_a_request_made_before_the_peer_was_loaded_again_is_stale():
    """NIXL's refusal of a handle built before the peer's agent was reloaded is StaleRequest (what push_write posts
    again from its rows); a released request is another AgentError; the same rows posted afresh land."""
    (src, src_buf), (dst, dst_buf) = _agent("src"), _agent("dst")
    try:
        _stale_then_fresh(src, src_buf, dst, dst_buf)
    finally:
        src.close()
        dst.close()


def _stale_then_fresh(src: NixlAgent, src_buf: np.ndarray, dst: NixlAgent, dst_buf: np.ndarray) -> None:
    peer = src.add_peer(dst.metadata)
    rows = 64
    local = np.array([[src_buf.ctypes.data, rows, 0]], dtype=np.uint64)
    remote = np.array([[dst_buf.ctypes.data, rows, 0]], dtype=np.uint64)
    prepared = src.prepare("WRITE", local, remote, peer)
    src.remove_peer(peer)
    assert src.add_peer(dst.metadata) == peer
    with pytest.raises(StaleRequest):
        src.post_prepared(prepared)
    released = src.prepare("WRITE", local, remote, peer)
    released.release()
    with pytest.raises(AgentError) as refused:
        src.post_prepared(released)
    assert not isinstance(refused.value, StaleRequest)
    xfer = src.post("WRITE", local, remote, peer)
    wait_for("the fresh WRITE", lambda: dst.notifications() is not None and src.check(xfer) is XferState.DONE)
    assert np.array_equal(dst_buf[:rows], src_buf[:rows])
