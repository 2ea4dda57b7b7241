"""The KV cache's geometry: one frozen CacheGeometry holds every size of a block-major cache and its byte math.

The cache is [num_blocks, layers_per_block, 2, num_kv_heads, block_size, head_dim] (2 = K then V; heads before
tokens inside a block: engine/kv_cache.py says why). Its byte sizes, smallest first:
  head_bytes        one head of one token's K (or V) in one layer: head_dim * elem_size
  token_bytes       one token's K (or V) in one layer: num_kv_heads * head_bytes
  head_block_bytes  one head's block_size rows of one region: contiguous (heads before tokens)
  region_bytes      one (layer, K/V) region of one block: num_kv_heads * head_block_bytes
  block_bytes       one block, K and V of every layer it holds: num_regions * region_bytes (the block stride)
Row `row` of head h in region r of block b lies offset(b, r, h, row) bytes past the cache's element 0.

Who holds it: the engine sizes and allocates its cache with it (engine/kv_cache.py), KVCacheSpec is it plus
where the cache is and whose it is (transfer/base.py), the handshake carries it (transfer/wire.py PeerInfo),
and the transfer layout addresses both sides with it (transfer/layout.py). Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.kv.groups import KVGroups


@dataclass(frozen=True)
class CacheGeometry:
    """One instance's (one tensor-parallel rank's) KV cache, sizes only; every field is >= 0 (a refused
    handshake reports 0 blocks of 0 tokens: it says nothing about where its cache is)."""

    num_blocks: int  # blocks of the cache (0: not sized yet)
    block_size: int  # tokens per block
    num_kv_heads: int  # KV heads this cache holds (a tensor-parallel rank's share, transfer/heads.py)
    total_kv_heads: int  # the model's KV heads (= num_kv_heads when one rank holds them all)
    head_dim: int  # elements per head per token
    elem_size: int  # bytes per element
    groups: KVGroups  # the model's KV layer groups (kv/groups.py); every block holds one group's layers

    def __post_init__(self) -> None:
        for f in ("num_blocks", "block_size", "num_kv_heads", "total_kv_heads", "head_dim", "elem_size"):
            if type(getattr(self, f)) is not int or getattr(self, f) < 0:
                raise ValueError(f"CacheGeometry.{f} must be an int >= 0, got {getattr(self, f)!r}")

    @classmethod
    def of(
        cls,
        layer_windows: tuple[int | None, ...],  # per model layer (empty: every layer sees the whole context)
        num_layers: int,
        num_kv_heads: int,  # this cache's
        head_dim: int,
        elem_size: int,
        block_size: int,
        num_blocks: int = 0,
        total_kv_heads: int = 0,  # the model's (0: num_kv_heads)
    ) -> CacheGeometry:
        """The geometry of a model's cache (its layers grouped by attention type, kv/groups.py)."""
        groups = KVGroups.of(layer_windows, num_layers)
        return cls(num_blocks, block_size, num_kv_heads, total_kv_heads or num_kv_heads, head_dim, elem_size, groups)

    def with_blocks(self, num_blocks: int) -> CacheGeometry:
        return dataclasses.replace(self, num_blocks=num_blocks)

    @property
    def layers_per_block(self) -> int:
        """Layers one block holds: every layer, or one KV group's."""
        return self.groups.layers_per_block

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV group's window (None: the whole context), in group order."""
        return self.groups.windows

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """[num_blocks, layers_per_block, 2, num_kv_heads, block_size, head_dim]."""
        return (self.num_blocks, self.layers_per_block, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def num_regions(self) -> int:
        """(layer, K/V) regions of one block."""
        return 2 * self.layers_per_block

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.elem_size

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def head_block_bytes(self) -> int:
        return self.block_size * self.head_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_kv_heads * self.head_block_bytes

    @property
    def block_bytes(self) -> int:
        """One block, K and V of every layer it holds: the distance between consecutive blocks."""
        return self.num_regions * self.region_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def offset(self, block: Any, region: Any = 0, head: Any = 0, row: Any = 0) -> Any:
        """Bytes from element 0 to row `row` of head `head` in region `region` of block `block` (ints, or numpy
        integer arrays of one shape: the transfer layout computes every descriptor's address at once)."""
        return (
            block * self.block_bytes + region * self.region_bytes + head * self.head_block_bytes + row * self.head_bytes
        )
