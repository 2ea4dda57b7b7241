"""CacheGeometry (kv/geometry.py): its sizes and offsets are those of the block-major shape, row-major."""

from __future__ import annotations

import math

import pytest

from pdserve.kv.geometry import CacheGeometry

# Gemma-3-like layer windows: 2 windowed and 2 full layers -> two groups of 2 layers per block
GEOMETRY = CacheGeometry.of((4, None, 4, None), 4, 3, 8, 2, 16, 5, total_kv_heads=6)


def byte_strides(shape: tuple[int, ...], elem: int) -> list[int]:
    return [elem * math.prod(shape[i + 1 :]) for i in range(len(shape))]


def test_shape_and_sizes() -> None:
    g = GEOMETRY
    assert g.shape == (5, 2, 2, 3, 16, 8)  # [blocks, layers per block, K/V, heads, block size, head dim]
    assert (g.layers_per_block, g.windows, g.num_regions) == (2, (None, 4), 4)
    assert (g.num_kv_heads, g.total_kv_heads) == (3, 6)
    assert g.total_bytes == math.prod(g.shape) * 2 and g.block_bytes == math.prod(g.shape[1:]) * 2
    assert (g.head_bytes, g.token_bytes, g.head_block_bytes, g.region_bytes) == (16, 48, 256, 768)


@pytest.mark.parametrize("block,region,head,row", [(0, 0, 0, 0), (4, 3, 2, 15), (2, 1, 1, 7), (3, 2, 0, 9)])
def test_offset_is_the_row_major_index(block: int, region: int, head: int, row: int) -> None:
    g = GEOMETRY
    layer, kv = divmod(region, 2)
    index = (block, layer, kv, head, row, 0)
    want = sum(i * s for i, s in zip(index, byte_strides(g.shape, 2), strict=True))
    assert g.offset(block, region, head, row) == want


def test_one_group_without_windows_and_sizes_checked() -> None:
    g = CacheGeometry.of((), 3, 2, 4, 4, 8)
    assert g.layers_per_block == 3 and g.windows == (None,) and g.total_kv_heads == 2 and g.num_blocks == 0
    assert g.with_blocks(7).total_bytes == 7 * g.block_bytes
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        g.with_blocks(-1)
    with pytest.raises(ValueError, match="block_size must be an int >= 0"):
        CacheGeometry(1, 2.0, 1, 1, 1, 1, g.groups)  # type: ignore[arg-type]
