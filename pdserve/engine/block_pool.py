"""Block pool: KV block ids, reference counts, an LRU free list and the prefix cache (pure Python).

Invariants:
- a block is in the free list iff its ref count is 0;
- a free block may still carry a hash (it is then an evictable prefix-cache entry, counted as free);
- allocation takes the least recently freed block and drops its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocks(RuntimeError):
    pass


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: equal hashes mean equal tokens from position 0 up to this block's end."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        """Blocks a new allocation could take (truly free plus evictable prefix-cache blocks)."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref count 1 each); raises NoFreeBlocks and takes nothing if fewer are free."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            h = self._hash[block_id]
            if h is not None:
                if self._cached.get(h) == block_id:
                    del self._cached[h]
                self._hash[block_id] = None
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks in reverse order so that its prefix,
        the part most likely shared, is evicted last."""
        for block_id in block_ids:
            cnt = self._ref_cnt[block_id]
            if cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_cnt[block_id] = cnt - 1
            if cnt == 1:
                self._free[block_id] = None

    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of these hashes (not yet referenced)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def cache(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block in the prefix cache (first writer of a hash wins)."""
        if not self.enable_prefix_caching or self._hash[block_id] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hash[block_id] = block_hash
