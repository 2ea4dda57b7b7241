"""Layout math on the block-major cache (heads before tokens in a block): token ranges -> byte regions, merging,
block-size translation, padded last blocks (no NIXL, no torch)."""

import numpy as np
import pytest

from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer.base import KVCacheSpec
from pdserve.transfer.layout import LayoutError, descriptors, num_bytes, pad_last_blocks, token_segments

TB = 32  # token bytes (of every head)


def lay(
    block_size: int, num_blocks: int = 16, base: int = 1 << 20, layers: int = 2, heads: int = 1, token_bytes: int = TB
) -> KVCacheSpec:
    """A cache of byte elements: token_bytes per token (of every head), at `base`."""
    geometry = CacheGeometry.of((), layers, heads, token_bytes // heads, 1, block_size, num_blocks)
    return KVCacheSpec(geometry, base, "DRAM", 0, "m", "uint8")


def apply(segments, local: KVCacheSpec, remote: KVCacheSpec, src: np.ndarray, dst: np.ndarray) -> int:
    """Copy bytes the way the descriptors say (remote -> local), on flat byte arrays; returns the descriptor count."""
    lo, ro = descriptors(local, remote, segments)
    assert int(lo[:, 1].sum()) == num_bytes(local.geometry, segments)
    for (la, n, _), (ra, n2, _) in zip(lo.tolist(), ro.tolist(), strict=True):
        assert n == n2
        dst[la - local.base_addr : la - local.base_addr + n] = src[ra - remote.base_addr : ra - remote.base_addr + n]
    return len(lo)


def addr(cache: KVCacheSpec, block_ids, region: int, head: int, t: int) -> int:
    """Byte offset of token t's head in a region, straight from [blocks, layers, 2, heads, block_size, head]."""
    g = cache.geometry
    bs, hb = g.block_size, g.head_bytes
    return block_ids[t // bs] * g.block_bytes + region * g.region_bytes + (head * bs + t % bs) * hb


def reference(local: KVCacheSpec, lids, remote: KVCacheSpec, rids, start, n, src, dst) -> None:
    """Token-by-token, head-by-head copy."""
    hb = local.geometry.head_bytes
    for r in range(local.geometry.num_regions):
        for h in range(local.geometry.num_kv_heads):
            for t in range(start, start + n):
                la, ra = addr(local, lids, r, h, t), addr(remote, rids, r, h, t)
                dst[la : la + hb] = src[ra : ra + hb]


def runs(lids, rids) -> int:
    """Runs of blocks contiguous on both sides."""
    return 1 + sum(1 for i in range(1, len(lids)) if lids[i] != lids[i - 1] + 1 or rids[i] != rids[i - 1] + 1)


def check(lbs, rbs, lids, rids, start, n, layers=2, heads=1) -> int:
    local, remote = lay(lbs, layers=layers, heads=heads), lay(rbs, base=1 << 30, layers=layers, heads=heads)
    src = np.random.default_rng(0).integers(0, 255, remote.geometry.total_bytes, dtype=np.uint8)
    got = np.zeros(local.geometry.total_bytes, dtype=np.uint8)  # untouched bytes stay 0
    want = got.copy()
    segs = token_segments(local.geometry, lids, remote.geometry, rids, start, n)
    count = apply(segs, local, remote, src, got)
    reference(local, lids, remote, rids, start, n, src, want)
    assert np.array_equal(got, want)
    assert num_bytes(local.geometry, segs) == local.geometry.num_regions * n * TB
    return count


@pytest.mark.parametrize(
    "lbs,rbs,lids,rids,start,n",
    [
        (4, 4, [3, 4, 5, 9], [0, 1, 2, 7], 0, 15),  # same size, partly contiguous, partial last block
        (4, 8, [0, 5, 6, 2, 9], [3, 1, 4], 4, 13),  # D smaller blocks, prefix hit of one block
        (8, 4, [2, 3, 7], [1, 2, 9, 10, 11, 5], 8, 15),  # D larger blocks
        (4, 6, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3], 0, 23),  # non-dividing sizes
        (4, 4, [2, 3], [5, 6], 4, 0),  # nothing to move
        (4, 4, [9, 2, 14, 0, 7, 6, 5], [1, 12, 3, 8, 4, 5, 6], 4, 24),  # scrambled, prefix hit, whole blocks
    ],
)
@pytest.mark.parametrize("heads", [1, 4])
def test_segments_match_token_by_token_copy(lbs, rbs, lids, rids, start, n, heads):
    check(lbs, rbs, lids, rids, start, n, heads=heads)


@pytest.mark.parametrize("layers", [1, 2, 5])
@pytest.mark.parametrize("seed", range(6))
def test_equal_block_sizes_one_descriptor_per_contiguous_run(layers, seed):
    rng = np.random.default_rng(seed)
    nblk = int(rng.integers(1, 12))
    lids = [int(x) for x in rng.permutation(16)[:nblk]]
    rids = [int(x) for x in rng.permutation(16)[:nblk]]
    if seed % 2:  # mostly contiguous: a few runs
        lids, rids = sorted(lids), sorted(rids)
    count = check(4, 4, lids, rids, 0, 4 * nblk, layers=layers)
    assert count == runs(lids, rids)  # independent of the number of layers


@pytest.mark.parametrize("heads", [1, 4])
def test_partial_last_block_is_one_descriptor_per_region_and_head(heads):
    # blocks 3, 4 whole and contiguous on both sides (one descriptor), then 2 tokens of block 9 / 7 per region
    # and head (heads before tokens: each head's rows are apart)
    assert check(4, 4, [3, 4, 9], [0, 1, 7], 0, 10, heads=heads) == 1 + 4 * heads


@pytest.mark.parametrize("heads", [1, 4])
def test_padded_last_block_is_the_whole_block(heads):
    """pad_last_blocks: the last block moves whole (rows past the range too), merged into its run of blocks;
    a first block that starts mid-block on either side is not padded."""
    local, remote = lay(4, heads=heads), lay(4, base=1 << 30, heads=heads)
    lg, rg = local.geometry, remote.geometry
    src = np.random.default_rng(1).integers(0, 255, rg.total_bytes, dtype=np.uint8)
    got = np.zeros(lg.total_bytes, dtype=np.uint8)
    want = got.copy()
    segs = pad_last_blocks(lg, rg, token_segments(lg, [3, 4, 5], rg, [0, 1, 2], 0, 10))
    assert apply(segs, local, remote, src, got) == 1
    reference(local, [3, 4, 5], remote, [0, 1, 2], 0, 12, src, want)  # through the end of block 5 / 2
    assert np.array_equal(got, want)
    segs = token_segments(lg, [3, 4], rg, [0, 1], 2, 4)  # rows 2, 3 of block 3 / 0, then 2 rows of 4 / 1
    assert [s.num_tokens for s in pad_last_blocks(lg, rg, segs)] == [2, 4]


def test_whole_cache_is_one_descriptor():
    local, remote = lay(4, num_blocks=2), lay(4, num_blocks=2, base=1 << 30)
    lo, ro = descriptors(local, remote, token_segments(local.geometry, [0, 1], remote.geometry, [0, 1], 0, 8))
    assert lo.tolist() == [[local.base_addr, 2 * local.geometry.block_bytes, 0]]
    assert ro.tolist() == [[remote.base_addr, 2 * remote.geometry.block_bytes, 0]]


def test_errors_name_the_problem():
    with pytest.raises(LayoutError, match="block id 16 is outside"):
        token_segments(lay(4).geometry, [16], lay(4).geometry, [0], 0, 2)
    with pytest.raises(LayoutError, match="remote has 1 blocks of 4 tokens, 2 needed"):
        token_segments(lay(4).geometry, [0, 1], lay(4).geometry, [0], 0, 5)
    with pytest.raises(LayoutError, match="head size differs"):
        token_segments(lay(4).geometry, [0], lay(4, token_bytes=64).geometry, [0], 0, 1)
    with pytest.raises(LayoutError, match="token size differs"):  # two heads of 32 B vs one: a slice is needed
        descriptors(
            lay(4), lay(4, heads=2, token_bytes=64), token_segments(lay(4).geometry, [0], lay(4).geometry, [0], 0, 1)
        )
    segs = token_segments(lay(4).geometry, [0], lay(4).geometry, [0], 0, 4)
    with pytest.raises(LayoutError, match="layer count differs"):
        descriptors(lay(4), lay(4, layers=3), segs)
