"""Head ranges across tensor-parallel sizes: every D rank gets exactly its heads of the transferred tokens from
the P ranks holding them, byte for byte, and nothing else changes (layout math on numpy arrays, no NIXL); the
rank merger's one-result-per-request rule; StepMeta between ranks round-trips."""

import numpy as np
import pytest

from pdserve.transfer.base import RecvTask, SendTask, StepMeta, TransferResults
from pdserve.transfer.heads import mapping_error, rank_heads, sources
from pdserve.transfer.layout import BlockLayout, Heads, descriptors, token_segments
from pdserve.transfer.params import PushSource
from pdserve.transfer.ranks import RankMerger, decode_meta, encode_meta

LAYERS, BS, NB, HD = 2, 4, 4, 2  # layers, block size, blocks, head dim (float32 elements)
L_BASE, R_BASE = 1 << 20, 1 << 30


def full_cache(total: int) -> np.ndarray:
    """P's whole model: [blocks, layers, 2, block_size, total heads, head_dim], every element distinct."""
    return np.arange(NB * LAYERS * 2 * BS * total * HD, dtype=np.float32).reshape(NB, LAYERS, 2, BS, total, HD)


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (4, 2, 4)])
def test_every_d_rank_gets_exactly_its_heads(total: int, p_tp: int, d_tp: int) -> None:
    p_blocks, d_blocks, start, n = [2, 0, 3], [1, 3, 0], 1, 9  # a partial first and last block
    full = full_cache(total)
    p = []
    for r in range(p_tp):
        h0, nh = rank_heads(total, p_tp, r)
        p.append(np.ascontiguousarray(full[:, :, :, :, h0 : h0 + nh]))
    for d_rank in range(d_tp):
        h0, nh = rank_heads(total, d_tp, d_rank)
        dst = np.full((NB, LAYERS, 2, BS, nh, HD), -1.0, dtype=np.float32)
        local = BlockLayout(L_BASE, LAYERS, NB, BS, nh * HD * 4, 0, nh)
        flat = dst.reshape(-1).view(np.uint8)
        for s in sources(total, p_tp, d_tp, d_rank):
            src = p[s.producer_rank]
            remote = BlockLayout(R_BASE, LAYERS, NB, BS, src.shape[4] * HD * 4, 0, src.shape[4])
            segs = token_segments(local, d_blocks, remote, p_blocks, start, n)
            lo, ro = descriptors(local, remote, segs, Heads(s.consumer_offset, s.producer_offset, s.num_heads))
            sflat = src.reshape(-1).view(np.uint8)
            for (la, ln, _), (ra, rn, _) in zip(lo.tolist(), ro.tolist(), strict=True):
                assert ln == rn
                flat[la - L_BASE : la - L_BASE + ln] = sflat[ra - R_BASE : ra - R_BASE + rn]
        want = np.full_like(dst, -1.0)
        for t in range(start, start + n):
            want[d_blocks[t // BS], :, :, t % BS] = full[p_blocks[t // BS], :, :, t % BS, h0 : h0 + nh]
        np.testing.assert_array_equal(dst, want)  # its heads landed; every other byte is still -1


def test_mapping_that_cannot_work_names_both_sides() -> None:
    assert mapping_error(2, 2, 2, 4) is None
    err = mapping_error(4, 3, 4, 1)
    assert err is not None and err.startswith("prefill TP 3 neither splits nor replicates the KV heads")
    assert "(prefill TP 3 with 4 KV heads, decode TP 1 with 4 KV heads)" in err


def test_merger_one_result_per_request() -> None:
    m = RankMerger(2)
    src = PushSource("t", "h", 1, "e")
    m.see(StepMeta(recvs=[RecvTask("a", (0,), 0, 4, src), RecvTask("b", (1,), 0, 4, src)]))
    m.add(0, TransferResults(finished_recvs=["a"], failed_recvs=[("b", "boom")], finished_sends=["s"]))
    out, followup = m.take()
    assert not out.finished_recvs and not out.failed_recvs and not out.finished_sends
    assert followup.cancels == ["b"]  # rank 1's part of b ends now; b is reported once both parts are over
    m.add(1, TransferResults(finished_recvs=["a"], cancelled_recvs=["b"], finished_sends=["s"]))
    out, followup = m.take()
    assert out.finished_recvs == ["a"] and out.failed_recvs == [("b", "tensor-parallel rank 0: boom")]
    assert out.finished_sends == ["s"] and not followup


def test_step_meta_round_trip() -> None:
    meta = StepMeta(recvs=[RecvTask("a", (0, 1), 0, 5, PushSource("t", "h", 9, "e", 2), 1)], cancels=["x"],
                    expected=[("r", "t")], releases=["y"])  # fmt: skip
    assert decode_meta(encode_meta(meta)) == meta
    tables = ((0, 1, 2), (-1, 3, 4))  # a windowed model: a table per KV group, STALE entries included
    windowed = StepMeta(recvs=[RecvTask("b", (0, 1, 2), 0, 9, PushSource("t", "h", 9, "e", 2), 0, tables)],
                        sends=[SendTask("c", (0, 1, 2), 10, "t", tables)])  # fmt: skip
    assert decode_meta(encode_meta(windowed)) == windowed
