"""Sliding-window KV groups between instances of different block sizes over real NIXL, pull and push, staged and
not: (P, D) block sizes (16, 4), (4, 16), (8, 16). The cache is test_windowed.py's (layers 0-1 full, layers 2-3 a
window of 8; two layers per block).

P holds 51 tokens; D computes token 50 itself, whose query reads keys 43..50. Each side holds the windowed group
from its own block holding key 43 (P freed the rest during its prefill, D never allocated it): tokens 40.. with
blocks of 4 or 8, 32.. with blocks of 16. The transfer moves [max of both starts, 50) = [40, 50): every key D
reads, only rows P still holds. A D of 16-token blocks therefore gets rows 40..47 of its block 2, not rows
32..39 (they stay untouched), reports landed_from (0, 40), and its engine keeps that block out of its prefix
cache (tests/unit/test_scheduler_windowed.py). Nothing is padded (layout.pad_last_blocks: equal sizes only)."""

import numpy as np
import pytest

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, push_params, start_all
from pdserve.transfer.faults import Faults

WINDOWS = (None, None, 8, 8)  # per model layer: group 0 = layers 0-1 (full), group 1 = layers 2-3 (window 8)
STALE = -1
N_PROMPT, N_MOVED, W_FIRST = 51, 50, 40
STAGED = Faults(force_staging=True)
TOKEN_ROW_BYTES = 2 * 2 * 2 * 4 * 4  # 2 layers x K/V x 2 heads x 4 dims x float32, per token
PAIRS = [(16, 4), (4, 16), (8, 16)]  # (P block size, D block size)


def tables(block_size: int) -> list[list[int]]:
    """Both groups' tables for N_PROMPT tokens, as the scheduler holds them (P after its prefill, D parked):
    group 0 every block, group 1 STALE before the block holding key 43. Ids descending, so no two neighbours
    are contiguous by luck."""
    n = -(-N_PROMPT // block_size)
    first = (N_PROMPT - 8) // block_size  # first_live_block(8, 50, block_size)
    ids = list(range(2 * n - first))[::-1]
    return [ids[:n], [STALE] * first + ids[n:]]


@pytest.fixture(scope="module")
def cl():
    def inst(role: str, mode: str, bs: int, staged: bool = False) -> Instance:
        faults = {"faults": STAGED} if staged else {}
        return Instance(role, mode, block_size=bs, num_blocks=32, windows=WINDOWS, **faults)

    insts = {f"p{bs}_{m}": inst("prefill", m, bs) for bs in (4, 8, 16) for m in ("pull", "push")}
    insts |= {f"d{bs}_{m}": inst("decode", m, bs) for bs in (4, 16) for m in ("pull", "push")}
    insts |= {f"p4_{m}_staged": inst("prefill", m, 4, True) for m in ("pull", "push")}
    insts |= {f"d16_{m}_staged": inst("decode", m, 16, True) for m in ("pull", "push")}
    yield start_all(**insts)
    close_all(insts)


def run(cl, mode: str, p_bs: int, d_bs: int, staged: str = "") -> None:
    """One transfer of N_MOVED tokens from P's tables to D's; checks D's cache byte for byte, the bytes counted
    on both sides and what D reports as landed."""
    p, d = cl[f"p{p_bs}_{mode}{staged}"], cl[f"d{d_bs}_{mode}{staged}"]
    pt, dt = tables(p_bs), tables(d_bs)
    rid = f"{mode}-{p_bs}-{d_bs}{staged}"
    p_kv, before = p.kv(), d.kv()
    sent, received = p.call("stats")["sent_bytes"], d.call("stats")["received_bytes"]
    if mode == "pull":
        keep, params = p.call("finish", f"p-{rid}", pt[0], N_PROMPT, {"do_remote_decode": True}, pt)
        assert keep and d.call("needs", rid, params) is True
        d.call("alloc", rid, dt[0], 0, N_PROMPT, dt)
    else:
        p_params, d_params = push_params(p, rid)
        assert d.call("needs", rid, d_params) is True
        d.call("alloc", rid, dt[0], 0, N_PROMPT, dt)
        keep, _ = p.call("finish", f"p-{rid}", pt[0], N_PROMPT, p_params, pt)
        assert keep
    kind, reason = d.wait_result(rid)
    assert kind == "finished", reason
    p.wait_send(f"p-{rid}")
    out = expected_kv(before, p_kv, dt[0], pt[0], 0, N_MOVED, bool(staged))
    out = expected_kv(out, p_kv, dt[1], pt[1], W_FIRST, N_MOVED - W_FIRST, bool(staged))
    after = d.kv()
    assert np.array_equal(after, out)  # only these rows changed: nothing before 40 in the windowed group
    if d_bs == 16:  # D's window block 2 holds tokens 32..47: rows 32..39 were never P's to send
        assert np.array_equal(after[dt[1][2], :, :, :, :8], before[dt[1][2], :, :, :, :8])
    assert dict(d.results()["landed_from"])[rid] == (0, W_FIRST)
    moved = (N_MOVED + N_MOVED - W_FIRST) * TOKEN_ROW_BYTES  # different block sizes: no block is padded
    assert d.call("stats")["received_bytes"] - received == moved
    assert p.call("stats")["sent_bytes"] - sent == moved


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_bs,d_bs", PAIRS)
def test_window_moves_between_block_sizes(cl, mode, p_bs, d_bs):
    run(cl, mode, p_bs, d_bs)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_window_moves_between_block_sizes_staged(cl, mode):
    run(cl, mode, 4, 16, "_staged")


def test_tables_follow_the_scheduler():
    for bs, first in ((4, 10), (8, 5), (16, 2)):
        full, windowed = tables(bs)
        n = -(-N_PROMPT // bs)
        assert len(full) == len(windowed) == n and windowed[:first] == [STALE] * first
        live = full + windowed[first:]
        assert STALE not in live and len(set(live)) == len(live) and max(live) < 32
