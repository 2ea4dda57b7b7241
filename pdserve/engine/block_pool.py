"""Block pool: KV block ids, reference counts, contiguity-keeping free runs and the prefix cache (pure Python).

Invariants:
- a block is free iff its ref count is 0;
- a free block may still carry a hash (it is then an evictable prefix-cache entry, counted as free); free blocks
  without a hash are kept as maximal runs of consecutive ids, free blocks with one in LRU order;
- allocation takes blocks without a hash first; only when those are too few does it evict prefix-cache blocks
  into the runs (dropping their hash): the least recently freed one, then its free neighbours by id (so what
  is evicted comes as runs; a neighbour may be more recently freed), then the next least recently freed one.

Why runs: the KV cache is block-major, so a transfer costs one NIXL descriptor per run of blocks contiguous on
both instances. Allocation takes the smallest run that holds the whole request (from its low end), or, when
none does, the longest runs first; allocate(after=...) first extends a request's last block in place. A freed
block merges with its free neighbours, so a request's blocks come back as the run they were. Cost per
allocation: O(blocks taken), plus a sort of the free runs when no single run holds the request; per free: O(1)
per block. Measured: a 1,024-block request after heavy churn of a 22,800-block pool takes ~0.5 ms.

Prefix-cache hashes are blake2b digests (128 bits) chained over the parent's digest and the token ids
(kv/block_hashes.py), so a hit is a match of every token from position 0 (a collision is as likely as guessing a
128-bit key), unlike a Python hash() of a tuple, which collides on crafted or merely unlucky inputs and silently
serves another prompt's KV.

KV events: with an event log attached (record_events; engine/kv_events.py), every key that enters the prefix
cache (cache()) or leaves it (an eviction in allocate()) is recorded there, O(1) per block, in the order the
pool's own map changes: the log's set of keys is always the pool's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pdserve.kv.block_hashes import BlockHash, hash_block

if TYPE_CHECKING:
    from pdserve.engine.kv_events import KVEventLog

__all__ = ["BlockHash", "BlockPool", "NoFreeBlocks", "hash_block"]


class NoFreeBlocks(RuntimeError):
    pass


class _Runs:
    """Free block ids as maximal runs [start, end): merge on insert, best-fit on take."""

    def __init__(self, num_blocks: int) -> None:
        self.count = 0  # blocks held
        self._end: dict[int, int] = {}  # run start -> end (exclusive)
        self._start: dict[int, int] = {}  # run end (exclusive) -> start
        self._by_len: dict[int, set[int]] = {}  # run length -> starts of runs of that length
        if num_blocks:
            self._add_run(0, num_blocks)
            self.count = num_blocks

    def _add_run(self, start: int, end: int) -> None:
        self._end[start], self._start[end] = end, start
        self._by_len.setdefault(end - start, set()).add(start)

    def _drop_run(self, start: int) -> int:
        end = self._end.pop(start)
        del self._start[end]
        starts = self._by_len[end - start]
        starts.discard(start)
        if not starts:
            del self._by_len[end - start]
        return end

    def add(self, block_id: int, end: int | None = None) -> None:
        """Insert free blocks [block_id, end) (default: the one block), merging with the runs around them."""
        start, end = block_id, block_id + 1 if end is None else end
        self.count += end - start
        left = self._start.get(start)
        if left is not None:
            self._drop_run(left)
            start = left
        if end in self._end:
            end = self._drop_run(end)
        self._add_run(start, end)

    def take_after(self, block_id: int, n: int) -> list[int]:
        """Up to n blocks from the run starting at block_id + 1 (extending a request in place)."""
        start = block_id + 1
        if start not in self._end:
            return []
        end = self._drop_run(start)
        k = min(n, end - start)
        if start + k < end:
            self._add_run(start + k, end)
        self.count -= k
        return list(range(start, start + k))

    def take(self, n: int) -> list[int]:
        """n blocks (n <= count): the smallest run holding all n (its lowest), else the longest runs first."""
        fits = [length for length in self._by_len if length >= n]
        if fits:
            start = min(self._by_len[min(fits)])
            end = self._drop_run(start)
            if start + n < end:
                self._add_run(start + n, end)
            self.count -= n
            return list(range(start, start + n))
        out: list[int] = []
        for length in sorted(self._by_len, reverse=True):  # no run holds n: whole runs, longest first
            for start in sorted(self._by_len[length]):
                k = min(n - len(out), length)
                end = self._drop_run(start)
                if start + k < end:
                    self._add_run(start + k, end)
                out.extend(range(start, start + k))
                if len(out) == n:
                    self.count -= n
                    return out
        raise AssertionError("take() asked for more blocks than the runs hold")

    def runs(self) -> list[tuple[int, int]]:
        """The free runs, sorted (for tests and benchmarks)."""
        return sorted(self._end.items())


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._runs = _Runs(num_blocks)  # free blocks without a hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free blocks with a hash, least recently freed first
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._events: KVEventLog | None = None  # where cache changes are recorded (record_events)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation could take (truly free plus evictable prefix-cache blocks)."""
        return self._runs.count + len(self._evictable)

    def record_events(self, log: KVEventLog | None) -> None:
        """From now on record every key entering or leaving the prefix cache in `log` (None: stop), which starts
        from the keys cached now. Call it from the thread that owns the pool (or before that thread starts)."""
        if log is not None:
            log.restart(self._cached)
        self._events = log

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def free_runs(self) -> list[tuple[int, int]]:
        """Runs [start, end) of free blocks without a hash, sorted."""
        return self._runs.runs()

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take n blocks (ref count 1 each); raises NoFreeBlocks and takes nothing if fewer are free.

        after: the request's current last block; blocks right after it are taken first when free."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        while self._runs.count < n:  # evict prefix-cache blocks into the runs: the least recently freed one,
            lo = hi = next(iter(self._evictable))  # then its free neighbours, so evictions come as runs
            want = n - self._runs.count
            while hi - lo + 1 < want and lo - 1 in self._evictable:  # down first: a request frees its tail
                lo -= 1  # first, so its head is next in LRU order
            while hi - lo + 1 < want and hi + 1 in self._evictable:
                hi += 1
            for block_id in range(lo, hi + 1):
                self._drop_hash(block_id)
            self._runs.add(lo, hi + 1)
        out = self._runs.take_after(after, n) if after is not None else []
        if len(out) < n:
            out.extend(self._runs.take(n - len(out)))
        for block_id in out:
            self._ref_cnt[block_id] = 1
        return out

    def _drop_hash(self, block_id: int) -> None:
        """Evict a free prefix-cache block (the caller puts it into the runs)."""
        del self._evictable[block_id]
        h = self._hash[block_id]
        if h is not None and self._cached.get(h) == block_id:
            del self._cached[h]
            if self._events is not None:
                self._events.removed(h)
        self._hash[block_id] = None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks in reverse order so that its prefix,
        the part most likely shared, is evicted last."""
        for block_id in block_ids:
            cnt = self._ref_cnt[block_id]
            if cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_cnt[block_id] = cnt - 1
            if cnt == 1:
                if self._hash[block_id] is None:
                    self._runs.add(block_id)
                else:
                    self._evictable[block_id] = None

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
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

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under this hash, or None (prefix caching off, or not cached)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._evictable[block_id]  # a cached block carries a hash, so a free one is evictable
            self._ref_cnt[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full, computed block in the prefix cache (first writer of a hash wins)."""
        if not self.enable_prefix_caching or self._hash[block_id] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hash[block_id] = block_hash
            if self._events is not None:
                self._events.stored(block_hash)
