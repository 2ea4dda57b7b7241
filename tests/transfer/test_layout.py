"""Layout math: token ranges -> byte regions, merging, block-size translation (no NIXL, no torch)."""

import numpy as np
import pytest

from pdserve.transfer.layout import BlockLayout, LayoutError, Segment, descriptors, num_bytes, token_segments

TB = 32  # token bytes


def lay(block_size: int, num_blocks: int = 16, base: int = 1 << 20, layers: int = 2) -> BlockLayout:
    return BlockLayout(base, layers, num_blocks, block_size, TB)


def apply(segments, local: BlockLayout, remote: BlockLayout, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy bytes the way the descriptors say (remote -> local), on flat byte arrays."""
    lo, ro = descriptors(local, remote, segments)
    for (la, n, _), (ra, n2, _) in zip(lo.tolist(), ro.tolist(), strict=True):
        assert n == n2
        dst[la - local.base_addr : la - local.base_addr + n] = src[ra - remote.base_addr : ra - remote.base_addr + n]


def reference(local: BlockLayout, lids, remote: BlockLayout, rids, start, n, src, dst) -> None:
    """Token-by-token copy straight from the layout definition."""
    for r in range(local.num_regions):
        for t in range(start, start + n):
            la = r * local.region_stride + lids[t // local.block_size] * local.block_bytes + (t % local.block_size) * TB
            ra = r * remote.region_stride + rids[t // remote.block_size] * remote.block_bytes
            ra += (t % remote.block_size) * TB
            dst[la : la + TB] = src[ra : ra + TB]


@pytest.mark.parametrize(
    "lbs,rbs,lids,rids,start,n",
    [
        (4, 4, [3, 4, 5, 9], [0, 1, 2, 7], 0, 15),  # same size, partly contiguous
        (4, 8, [0, 5, 6, 2, 9], [3, 1, 4], 4, 13),  # D smaller blocks, prefix hit of one block
        (8, 4, [2, 3, 7], [1, 2, 9, 10, 11, 5], 8, 15),  # D larger blocks
        (4, 6, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3], 0, 23),  # non-dividing sizes
        (4, 4, [2, 3], [5, 6], 4, 0),  # nothing to move
    ],
)
def test_segments_match_token_by_token_copy(lbs, rbs, lids, rids, start, n):
    local, remote = lay(lbs), lay(rbs, base=1 << 30)
    src = np.random.default_rng(0).integers(0, 255, remote.num_regions * remote.region_stride, dtype=np.uint8)
    got = np.zeros(local.num_regions * local.region_stride, dtype=np.uint8)
    want = got.copy()
    segs = token_segments(local, lids, remote, rids, start, n)
    apply(segs, local, remote, src, got)
    reference(local, lids, remote, rids, start, n, src, want)
    assert np.array_equal(got, want)
    assert num_bytes(local, segs) == local.num_regions * n * TB


def test_contiguous_runs_merge_into_one_segment():
    segs = token_segments(lay(4), [3, 4, 5], lay(4), [7, 8, 9], 0, 12)
    assert segs == [Segment(3 * 4 * TB, 7 * 4 * TB, 12 * TB)]
    lo, ro = descriptors(lay(4), lay(4), segs)
    assert lo.shape == (4, 3) and ro.shape == (4, 3)  # one per (layer, K/V) region


def test_split_at_both_block_boundaries():
    # local blocks of 4 are not contiguous; remote blocks of 8 are: cut every 4 tokens on the local side
    segs = token_segments(lay(4), [0, 2, 4], lay(8), [1, 2], 0, 10)
    assert [(s.local_offset // TB, s.remote_offset // TB, s.length // TB) for s in segs] == [
        (0, 8, 4), (8, 12, 4), (16, 16, 2)
    ]  # fmt: skip


def test_whole_cache_merges_across_regions():
    local, remote = lay(4, num_blocks=2), lay(4, num_blocks=2, base=1 << 30)
    lo, ro = descriptors(local, remote, token_segments(local, [0, 1], remote, [0, 1], 0, 8))
    assert lo.tolist() == [[local.base_addr, 4 * local.region_stride, 0]]


def test_errors_name_the_problem():
    with pytest.raises(LayoutError, match="block id 16 is outside"):
        token_segments(lay(4), [16], lay(4), [0], 0, 2)
    with pytest.raises(LayoutError, match="remote has 1 blocks of 4 tokens, 2 needed"):
        token_segments(lay(4), [0, 1], lay(4), [0], 0, 5)
    with pytest.raises(LayoutError, match="token size differs"):
        token_segments(lay(4), [0], BlockLayout(0, 2, 16, 4, 64), [0], 0, 1)
