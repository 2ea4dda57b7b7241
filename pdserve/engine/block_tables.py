"""A request's block tables, one per KV group, against the block pool: grow, free, and give back what a window
no longer reads.

Lives apart from the scheduler because it is the one place that turns token counts into blocks (every group
grows together, all or nothing) and knows the STALE entries of windowed groups (kv/groups.py); the
scheduler decides who gets blocks, this decides which. Pure Python, no torch.
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.kv.groups import STALE, KVGroups
from pdserve.kv.params import RemoteDecode


class BlockTables:
    """Allocates and frees the blocks of requests' per-group tables (Request.block_tables)."""

    def __init__(self, pool: BlockPool, block_size: int, kv_groups: KVGroups) -> None:
        self.pool = pool
        self.block_size = block_size
        self.kv_groups = kv_groups

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_to(self, req: Request, num_tokens: int) -> bool:
        """Grow every group's table to hold num_tokens; False (nothing taken) when the pool has too few blocks."""
        want = self._blocks_for(num_tokens)
        needs = [want - len(t) for t in req.block_tables]
        if sum(n for n in needs if n > 0) > self.pool.num_free:
            return False
        for table, need in zip(req.block_tables, needs, strict=True):
            if need > 0:
                last = table[-1] if table and table[-1] != STALE else None
                table.extend(self.pool.allocate(need, after=last))
        return True

    def free(self, req: Request) -> None:
        """Give every block of the request back to the pool (cached ones stay evictable prefix-cache entries)."""
        for table in req.block_tables:
            self.pool.free(b for b in reversed(table) if b != STALE)
        req.block_tables = [[] for _ in self.kv_groups.groups]
        req.kv_valid_from = []

    def for_transfer(self, req: Request) -> list[list[int]]:
        """What the connector hooks get as block_tables: every group's table for a windowed model, else []."""
        return [list(t) for t in req.block_tables] if self.kv_groups.is_windowed else []

    def free_out_of_window(self, req: Request) -> None:
        """Give back every windowed group's blocks that no later query of the request can read. P keeps one
        token more for a request it hands to a remote decode: a D that computes the last prompt token itself
        (P handed no first token over, e.g. to a vLLM decode instance) needs the window before that token
        (position num_computed - 1); one that takes P's first token needs the window before num_computed, a
        part of it."""
        keep_from = req.num_computed_tokens - (1 if isinstance(req.kv_transfer_params, RemoteDecode) else 0)
        for g, table in enumerate(req.block_tables):
            first = min(self.kv_groups.first_live_block(g, keep_from, self.block_size), len(table))
            dead = [b for b in table[:first] if b != STALE]
            if dead:
                self.pool.free(reversed(dead))  # registered ones stay evictable prefix-cache entries
                table[:first] = [STALE] * first
