"""The prefix cache's policy: which cached blocks a new request resumes from, and which of its blocks to register.

Block hashes are chained (kv/block_hashes.py, the scheme GET /kv_events states) and memoised on the request; a
windowed KV group (kv/groups.py) keys its blocks apart from group 0's (block_hashes.group_key) and needs only
the window's blocks, the entries before them STALE. Lives apart from the scheduler because it is one policy with
its own invariants (a hit never covers the last token; a block with rows D never received is never registered,
nor any block of a request whose KV was received unauthenticated: Request.cache_blocks) that the token-budget
loop only calls.
Pure Python, no torch.
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.kv.block_hashes import group_key, hash_block
from pdserve.kv.groups import STALE, KVGroups


class PrefixCache:
    """Looks requests' prompts up in the pool's prefix cache and registers their full blocks there."""

    def __init__(self, pool: BlockPool, block_size: int, kv_groups: KVGroups) -> None:
        self.pool = pool
        self.block_size = block_size
        self.kv_groups = kv_groups

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first num_blocks full blocks (memoised on the request)."""
        bs = self.block_size
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))
        return req.block_hashes[:num_blocks]

    def take_hits(self, req: Request) -> None:
        """Give a request without blocks its longest cached prefix (tables, computed and cached counts)."""
        # at least one token must be computed (its logits give the next token), so cap at num_tokens - 1
        max_blocks = (req.num_tokens - 1) // self.block_size
        tables = self._prefix_hits(self._hashes(req, max_blocks)) if self.pool.enable_prefix_caching else []
        if not tables:
            tables = [[] for _ in self.kv_groups.groups]
        for table in tables:
            self.pool.touch(b for b in table if b != STALE)
        req.block_tables = tables
        num_hits = len(tables[0])
        req.num_computed_tokens = req.num_cached_tokens = num_hits * self.block_size
        req.num_hashed_blocks = num_hits

    def _prefix_hits(self, hashes: list[bytes]) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix every group can resume from ([] if none): a
        full-attention group needs all its blocks cached, a windowed group only those of the window before the
        first position computed; the table entries before them are STALE."""
        groups, bs = self.kv_groups.groups, self.block_size
        full = [g for g, group in enumerate(groups) if group.window is None]
        cached = [self.pool.lookup([group_key(g, h) for h in hashes]) for g in full]
        k = min((len(c) for c in cached), default=len(hashes))
        for num in range(k, 0, -1):
            tables: list[list[int]] = []
            for g in range(len(groups)):
                if groups[g].window is None:
                    tables.append(cached[full.index(g)][:num])
                    continue
                first = self.kv_groups.first_live_block(g, num * bs, bs)
                live = [self.pool.cached_block(group_key(g, h)) for h in hashes[first:num]]
                if any(b is None for b in live):
                    break
                tables.append([STALE] * first + [b for b in live if b is not None])
            else:
                return tables
        return []

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly full blocks (those computed since the last call) under their hashes."""
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_hashed_blocks or not self.pool.enable_prefix_caching or not req.cache_blocks:
            return
        hashes = self._hashes(req, num_full)
        for g, table in enumerate(req.block_tables):
            # a block with rows D never received (before kv_valid_from) must not serve another request
            valid_from = req.kv_valid_from[g] if req.kv_valid_from else 0
            for i in range(req.num_hashed_blocks, num_full):
                if table[i] != STALE and i * self.block_size >= valid_from:
                    self.pool.cache(table[i], group_key(g, hashes[i]))
        req.num_hashed_blocks = num_full
