"""Head ranges across tensor-parallel sizes: every D rank gets exactly its heads of the transferred tokens from
the P ranks holding them, byte for byte, and nothing else changes (layout math on numpy arrays, no NIXL); the
rank merger's one-result-per-request rule; StepMeta between ranks round-trips."""

import numpy as np
import pytest

from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.params import PushSource
from pdserve.transfer.base import KVCacheSpec, RecvTask, SendTask, StepMeta, TransferResults, TransferStats
from pdserve.transfer.heads import mapping_error, rank_heads, sources
from pdserve.transfer.layout import Heads, descriptors, pad_last_blocks, token_segments
from pdserve.transfer.ranks import RankMerger, decode_meta, decode_results, encode_meta, encode_results

LAYERS, BS, NB, HD = 2, 4, 4, 2  # layers, block size, blocks, head dim (float32 elements)
L_BASE, R_BASE = 1 << 20, 1 << 30


def cache(base: int, layers: int, num_blocks: int, block_size: int, heads: int) -> KVCacheSpec:
    """A rank's float32 cache of `heads` KV heads at `base`."""
    geometry = CacheGeometry.of((), layers, heads, HD, 4, block_size, num_blocks)
    return KVCacheSpec(geometry, base, "DRAM", 0, "m", "float32")


def full_cache(total: int) -> np.ndarray:
    """P's whole model: [blocks, layers, 2, total heads, block_size, head_dim], every element distinct."""
    return np.arange(NB * LAYERS * 2 * total * BS * HD, dtype=np.float32).reshape(NB, LAYERS, 2, total, BS, HD)


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (4, 2, 4)])
def test_every_d_rank_gets_exactly_its_heads(total: int, p_tp: int, d_tp: int) -> None:
    p_blocks, d_blocks, start, n = [2, 0, 3], [1, 3, 0], 1, 9  # a partial first and last block
    full = full_cache(total)
    p = []
    for r in range(p_tp):
        h0, nh = rank_heads(total, p_tp, r)
        p.append(np.ascontiguousarray(full[:, :, :, h0 : h0 + nh]))
    for d_rank in range(d_tp):
        h0, nh = rank_heads(total, d_tp, d_rank)
        dst = np.full((NB, LAYERS, 2, nh, BS, HD), -1.0, dtype=np.float32)
        local = cache(L_BASE, LAYERS, NB, BS, nh)
        flat = dst.reshape(-1).view(np.uint8)
        for s in sources(total, p_tp, d_tp, d_rank):
            src = p[s.producer_rank]
            remote = cache(R_BASE, LAYERS, NB, BS, src.shape[3])
            segs = token_segments(local.geometry, d_blocks, remote.geometry, p_blocks, start, n)
            lo, ro = descriptors(local, remote, segs, Heads(s.consumer_offset, s.producer_offset, s.num_heads))
            sflat = src.reshape(-1).view(np.uint8)
            for (la, ln, _), (ra, rn, _) in zip(lo.tolist(), ro.tolist(), strict=True):
                assert ln == rn
                flat[la - L_BASE : la - L_BASE + ln] = sflat[ra - R_BASE : ra - R_BASE + rn]
        want = np.full_like(dst, -1.0)
        for t in range(start, start + n):
            want[d_blocks[t // BS], :, :, :, t % BS] = full[p_blocks[t // BS], :, :, h0 : h0 + nh, t % BS]
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


def test_landed_from_crosses_the_ranks_and_the_merger() -> None:
    """A windowed recv's first landed token per KV group (TransferResults.landed_from) reaches the engine once."""
    res = TransferResults(finished_recvs=["a"], landed_from={"a": (0, 40)})
    assert decode_results(encode_results(res, TransferStats()))[0] == res
    m = RankMerger(2)
    m.see(StepMeta(recvs=[RecvTask("a", (0,), 0, 50, PushSource("t", "h", 1, "e"))]))
    m.add(0, res)
    assert not m.take()[0].landed_from  # rank 1's part is not over yet
    m.add(1, res)
    out, _ = m.take()
    assert out.finished_recvs == ["a"] and out.landed_from == {"a": (0, 40)}


def test_step_meta_round_trip() -> None:
    meta = StepMeta(recvs=[RecvTask("a", (0, 1), 0, 5, PushSource("t", "h", 9, "e", 2), 1)], cancels=["x"],
                    expected=[("r", "t")], releases=["y"])  # fmt: skip
    assert decode_meta(encode_meta(meta)) == meta
    tables = ((0, 1, 2), (-1, 3, 4))  # a windowed model: a table per KV group, STALE entries included
    windowed = StepMeta(recvs=[RecvTask("b", (0, 1, 2), 0, 9, PushSource("t", "h", 9, "e", 2), 0, tables)],
                        sends=[SendTask("c", (0, 1, 2), 10, "t", tables)])  # fmt: skip
    assert decode_meta(encode_meta(windowed)) == windowed


def _whole_block_counts(total: int, p_tp: int, d_tp: int, blocks: int, layers: int) -> list[tuple[int, int]]:
    """(descriptors, expected) per (D rank, producer) for `blocks` whole blocks, D's ids reversed (no runs merge):
    one per (block, layer, K/V) for a head slice, one per block when the slice is every head of both ranks."""
    out = []
    for d_rank in range(d_tp):
        _, nh = rank_heads(total, d_tp, d_rank)
        local = cache(L_BASE, layers, 64, BS, nh)
        for s in sources(total, p_tp, d_tp, d_rank):
            _, ph = rank_heads(total, p_tp, s.producer_rank)
            remote = cache(R_BASE, layers, 64, BS, ph)
            segs = token_segments(
                local.geometry, list(range(blocks, 0, -1)), remote.geometry, list(range(blocks)), 0, blocks * BS
            )
            lo, _ = descriptors(local, remote, segs, Heads(s.consumer_offset, s.producer_offset, s.num_heads))
            out.append((len(lo), blocks if s.num_heads == nh == ph else blocks * layers * 2))
    return out


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [(8, 2, 1), (8, 1, 2), (8, 8, 4), (8, 4, 8), (2, 4, 1), (1, 1, 2)])
def test_head_slice_of_whole_blocks_is_one_descriptor_per_block_layer_and_kv(total: int, p_tp: int, d_tp: int) -> None:
    """Heads before tokens: a rank's head slice of a (block, layer, K/V) is one contiguous range on both sides."""
    counts = _whole_block_counts(total, p_tp, d_tp, blocks=5, layers=3)
    assert [got for got, _ in counts] == [want for _, want in counts]
    assert any(want == 5 * 3 * 2 for _, want in counts) or (total, p_tp, d_tp) == (1, 1, 2)


def test_padded_last_block_stays_one_descriptor_per_region() -> None:
    """A partial last block is one descriptor per (region, head) of the slice; padded (pad_last_blocks) it is one
    per region like the whole blocks, and a slice that is every head of both sides merges into the block runs."""
    local = cache(L_BASE, LAYERS, NB, BS, 4)  # D: 4 heads
    remote = cache(R_BASE, LAYERS, NB, BS, 2)  # a P rank: 2 of them
    segs = token_segments(
        local.geometry, [0, 1], remote.geometry, [2, 0], 0, BS + 1
    )  # one whole block, one token of the next
    heads = Heads(2, 0, 2)
    assert len(descriptors(local, remote, segs, heads)[0]) == 2 * LAYERS + 2 * LAYERS * 2
    padded = pad_last_blocks(local.geometry, remote.geometry, segs)
    assert [s.num_tokens for s in padded] == [BS, BS]
    assert len(descriptors(local, remote, padded, heads)[0]) == 2 * 2 * LAYERS
    same = cache(R_BASE, LAYERS, NB, BS, 4)  # equal TP: the padded run is one descriptor
    segs = token_segments(local.geometry, [0, 1], same.geometry, [3, 0], 0, BS + 1)
    assert len(descriptors(local, same, segs)[0]) == 1 + 2 * LAYERS * 4
    segs = token_segments(local.geometry, [0, 1], same.geometry, [2, 3], 0, BS + 1)  # contiguous on both sides
    assert len(descriptors(local, same, pad_last_blocks(local.geometry, same.geometry, segs))[0]) == 1
    other = cache(R_BASE, LAYERS, NB, 2 * BS, 4)  # block sizes differ: nothing padded
    segs = token_segments(local.geometry, [0, 1], other.geometry, [1], 0, BS + 1)
    assert pad_last_blocks(local.geometry, other.geometry, segs) == segs


def test_a_refused_recv_stays_the_requests_error_across_the_ranks() -> None:
    """A recv whose producer said it holds no such KV (TransferResults.refused_recvs: D answers its client 400)
    is still marked so after the wire between ranks and the merger; another rank's plain failure is not."""
    res = TransferResults(failed_recvs=[("b", "no pin here")], refused_recvs=["b"])
    assert decode_results(encode_results(res, TransferStats()))[0] == res
    src = PushSource("t", "h", 1, "e")
    m = RankMerger(2)
    m.see(StepMeta(recvs=[RecvTask("b", (1,), 0, 4, src), RecvTask("c", (2,), 0, 4, src)]))
    m.add(0, res)
    m.add(1, TransferResults(cancelled_recvs=["b"], failed_recvs=[("c", "handshake failed")]))
    m.add(0, TransferResults(cancelled_recvs=["c"]))
    out, _ = m.take()
    assert sorted(rid for rid, _ in out.failed_recvs) == ["b", "c"] and out.refused_recvs == ["b"]
