"""Head ranges across tensor-parallel sizes: every D rank gets exactly its heads of the transferred tokens
from the P ranks holding them, byte for byte, and nothing else changes (layout math on numpy arrays, no NIXL);
the rank merger's one-result-per-request rule."""

import numpy as np
import pytest

from pdserve.transfer.base import RecvTask, StepMeta, TransferResults
from pdserve.transfer.heads import mapping_error, num_producers, rank_heads, sources
from pdserve.transfer.layout import BlockLayout, Heads, descriptors, token_segments
from pdserve.transfer.params import PushSource
from pdserve.transfer.ranks import RankMerger, decode_meta, encode_meta

LAYERS, BS, NB, HD = 2, 4, 4, 2  # layers, block size, blocks, head dim (float32 elements)


def cache(heads: int, fill: float | None, rank_slice: tuple[int, int], total: int) -> np.ndarray:
    """[blocks, layers, 2, block_size, heads, head_dim] float32; P's values encode (block, layer, kv, row, model head)."""
    shape = (NB, LAYERS, 2, BS, heads, HD)
    if fill is not None:
        return np.full(shape, fill, dtype=np.float32)
    full = np.arange(NB * LAYERS * 2 * BS * total * HD, dtype=np.float32).reshape(NB, LAYERS, 2, BS, total, HD)
    return full[:, :, :, :, rank_slice[0] : rank_slice[0] + rank_slice[1]].copy()


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (4, 2, 4)])
def test_every_d_rank_gets_exactly_its_heads(total: int, p_tp: int, d_tp: int) -> None:
    p_blocks, d_blocks, start, n = [2, 0, 3], [1, 3, 0], 1, 9  # a partial first and last block
    p = [cache(rank_heads(total, p_tp, r)[1], None, rank_heads(total, p_tp, r), total) for r in range(p_tp)]
    full = cache(total, None, (0, total), total)
    for d_rank in range(d_tp):
        h0, nh = rank_heads(total, d_tp, d_rank)
        dst = cache(nh, -1.0, (0, nh), total)
        before = dst.copy()
        local = BlockLayout(1 << 20, LAYERS, NB, BS, nh * HD * 4, 0, nh)
        flat = dst.reshape(-1).view(np.uint8)
        for s in sources(total, p_tp, d_tp, d_rank):
            src = p[s.producer_rank]
            remote = BlockLayout(1 << 30, LAYERS, NB, BS, src.shape[4] * HD * 4, 0, src.shape[4])
            segs = token_segments(local, d_blocks, remote, p_blocks, start, n)
            lo, ro = descriptors(local, remote, segs, Heads(s.consumer_offset, s.producer_offset, s.num_heads))
            sflat = src.reshape(-1).view(np.uint8)
            for (la, ln, _), (ra, rn, _) in zip(lo.tolist(), ro.tolist(), strict=True):
                assert ln == rn
                flat[la - (1 << 20) : la - (1 << 20) + ln] = sflat[ra - (1 << 30) : ra - (1 << 30) + rn]
        want = before.copy()
        for t in range(start, start + n):
            want[d_blocks[t // BS], :, :, t % BS] = full[p_blocks[t // BS], :, :, t % BS, h0 : h0 + nh]
        np.testing.assert_array_equal(dst, want)  # the heads landed; every other byte is still -1
        assert num_producers(total, p_tp, d_tp, d_rank) == len(
            {s.producer_rank for s in sources(total, p_tp, d_tp, d_rank)}
        )


def test_mapping_that_cannot_work_names_both_sides() -> None:
    assert mapping_error(2, 2, 2, 4) is None
    assert (
        mapping_error(4, 3, 4, 1)
        == "prefill TP 3 neither splits nor replicates the KV heads (prefill TP 3 with 4 KV heads, decode TP 1 with 4 KV heads)"
    )


def test_merger_one_result_per_request() -> None:
    m = RankMerger(2)
    src = PushSource("t", "h", 1, "e")
    m.see(StepMeta(recvs=[RecvTask("a", (0,), 0, 4, src), RecvTask("b", (1,), 0, 4, src)]))
    m.add(0, TransferResults(finished_recvs=["a"], failed_recvs=[("b", "boom")], finished_sends=["s"]))
    out, followup = m.take()
    assert not out.finished_recvs and not out.failed_recvs and not out.finished_sends
    assert followup.cancels == ["b"]  # rank 1's part of b ends now
    m.add(1, TransferResults(finished_recvs=["a"], cancelled_recvs=["b"], finished_sends=["s"]))
    out, followup = m.take()
    assert out.finished_recvs == ["a"] and out.failed_recvs == [("b", "tensor-parallel rank 0: boom")]
    assert out.finished_sends == ["s"] and not followup


def test_step_meta_round_trip() -> None:
    meta = StepMeta(recvs=[RecvTask("a", (0, 1), 0, 5, PushSource("t", "h", 9, "e", 2), 1)], cancels=["x"],
                    expected=[("r", "t")], releases=["y"])  # fmt: skip
    assert decode_meta(encode_meta(meta)) == meta
