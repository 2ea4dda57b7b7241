"""Drive the Decoder by hand: a KV cache with a shuffled block allocator and one-step AttentionContexts."""

from __future__ import annotations

import torch

from pdserve.model.arch import ModelArch
from pdserve.model.decoder import Decoder
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan


class PagedCache:
    """KV cache [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] plus per-sequence block tables.

    Blocks are handed out from a shuffled free list, so a sequence's blocks are neither contiguous nor ordered.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32):
        shape = (num_blocks, arch.num_layers, 2, arch.num_kv_heads, block_size, arch.head_dim)
        # large finite garbage: attending to a slot that was never written shows up in the logits
        self.kv = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        self.lens: dict[int, int] = {}  # seq id -> tokens with KV

    def reserve(self, seq: int, num_tokens: int) -> list[int]:
        """Grow `seq`'s block table to hold `num_tokens`; returns the table."""
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size


def step(
    decoder: Decoder, cache: PagedCache, items: list[tuple[int, list[int]]], use_decode_batch: bool = True
) -> list[torch.Tensor]:
    """One forward pass; items = (seq id, new token ids) in row order. Returns logits [len(ids), vocab] per item.

    An item with one token goes to the DecodeBatch when use_decode_batch, otherwise to a PrefillSpan.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
    rows, tables, lens = [], [], []
    for seq, ids in items:
        start, row = cache.lens.get(seq, 0), len(input_ids)
        table = cache.reserve(seq, start + len(ids))
        input_ids += ids
        positions += range(start, start + len(ids))
        slots += [cache.slot(seq, p) for p in range(start, start + len(ids))]
        cache.lens[seq] = start + len(ids)
        if len(ids) == 1 and use_decode_batch:
            rows.append(row)
            tables.append(list(table))
            lens.append(start + 1)
        else:
            prefills.append(PrefillSpan(row, len(ids), start + len(ids), torch.tensor(table)))
    decode = None
    if rows:
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, max_blocks], pad = block 0
        decode = DecodeBatch(torch.tensor(rows), padded, torch.tensor(lens), max(lens))
    ctx = AttentionContext(torch.tensor(slots), prefills, decode, cache.block_size)
    with torch.no_grad():
        hidden = decoder(torch.tensor(input_ids), torch.tensor(positions), cache.kv, ctx)  # [T, hidden]
        logits = decoder.logits(hidden)  # [T, vocab] float32
    out, row = [], 0
    for _, ids in items:
        out.append(logits[row : row + len(ids)])
        row += len(ids)
    return out
