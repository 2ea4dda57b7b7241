"""Fail-closed KV checksum (`--kv-checksum`): a sum over exactly the KV a transfer moves, computed by the
producer over its source blocks and by the consumer over the blocks it received, compared before the request
leaves WAITING_FOR_REMOTE_KV (thread/kv_verify.py).

What is summed: one *part* of a transfer, what one P rank sends one D rank (heads.py), in logical coordinates
rather than byte ranges: per KV group g, the tokens [first, end) the transfer moves (layout.group_ranges:
the transferred rows, never the rows past them that pad_last_blocks sends along), every layer slot and K/V
(region r), the part's heads j in [0, num) (each side's slice starts at its own offset), every word i of one
head's row. Both sides hold identical bytes there whatever their block sizes, TP sizes, host staging or
descriptors; and since positions are logical, a layout bug that moves the right bytes to the wrong place
(block, region, head or row) changes the sum, where a sum over the descriptors' byte ranges would agree with
itself on both sides.

The sum: two int64 lanes, Fletcher-like, mod 2^64, over the words x (an int32 view of the KV; int16 or uint8
when a head's row is not a multiple of 4 bytes):
    s1 = sum(x),   s2 = sum(x * (1 + g*KG + t*KT + r*KR + j*KJ + i))
s1 changes with any one changed word (an exact integer sum: a flipped byte is always caught); s2 with two
words, rows or blocks swapped (their positions differ). The weight is a sum of per-coordinate terms, so s2
needs no weight tensor: it combines marginal sums (per block, row, region, head, word) that torch reduces in
two passes over views of the cache: no copy for a run of consecutive blocks (what the block pool hands out),
a gather in bounded chunks otherwise, on the cache's own device. A GPU cache is summed by CUDA reductions on
a side stream of the transfer thread; only the two sums reach the host. Addition and multiplication mod 2^64
are associative and commutative, so CPU and GPU, and any reduction order, agree to the bit. Not a MAC: it
catches corruption in transit, not an adversary (the deployment secret guards the side channel).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

KG = 1 << 48  # weight offset per KV group (a group's positions stay below it up to ~2^48 / KT tokens)
MIN_RUN = 8  # consecutive blocks summed through a view; shorter runs are gathered
GATHER_BYTES = 256 << 20  # at most this much KV copied per gather (bounded scratch)


class KVChecksum:
    """Sums over one KV cache buffer (the one NIXL registered: the host mirror when staging)."""

    def __init__(self, kv: torch.Tensor) -> None:
        # kv: [num_blocks, layers, 2, heads, block_size, head_dim]
        self.block_size, self.num_heads = kv.shape[4], kv.shape[3]
        raw = kv.view(torch.uint8)  # [num_blocks, layers, 2, heads, block_size, row_bytes]
        row_bytes = raw.shape[-1]
        word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
        self.raw = raw
        self.words = raw.view(word).flatten(1, 2)  # [num_blocks, regions, heads, block_size, words]
        self.block_bytes = raw[0].numel()
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    def part(
        self, tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]], head0: int, num_heads: int
    ) -> list[int]:
        """[s1, s2] over tokens ranges[g] of tables[g] for every KV group g, heads [head0, head0 + num_heads)."""
        if not (num_heads >= 1 and 0 <= head0 and head0 + num_heads <= self.num_heads):
            raise ValueError(f"heads [{head0}, {head0 + num_heads}) outside this cache's {self.num_heads}")
        if len(tables) != len(ranges):
            raise ValueError(f"{len(tables)} block tables for {len(ranges)} token ranges")
        with _on(self.stream):  # (the copy of the two sums to the host synchronizes the stream)
            return [int(v) for v in self._sum(tables, ranges, head0, num_heads).tolist()]

    def flip_byte(self, table: Sequence[int], token: int, head: int) -> None:
        """Test fault (Faults.flip_kv_byte): flip one bit of the first byte of token's row of `head`, layer 0, K."""
        b, row = table[token // self.block_size], token % self.block_size
        with _on(self.stream):
            self.raw[b, 0, 0, head, row, :1].bitwise_xor_(1)
            if self.stream is not None:
                self.stream.synchronize()

    def _sum(
        self, tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]], head0: int, num_heads: int
    ) -> torch.Tensor:
        acc = torch.zeros(2, dtype=torch.int64, device=self.words.device)
        for g, (table, (first, end)) in enumerate(zip(tables, ranges, strict=True)):
            for blocks, ks, r0, r1 in self._pieces(table, first, end):
                x = blocks[:, :, head0 : head0 + num_heads, r0:r1]  # [blocks, regions, heads, rows, words]
                acc += self._piece(x, ks, r0, g)
        return acc

    def _pieces(self, table: Sequence[int], first: int, end: int) -> Iterator[tuple[torch.Tensor, list[int], int, int]]:
        """(words of some blocks [m, regions, heads, block_size, words], their table indices, rows [r0, r1))
        covering tokens [first, end) of one table: partial blocks alone, whole blocks by runs or gathers."""
        bs, t = self.block_size, first
        gather: list[int] = []  # table indices of whole blocks in runs shorter than MIN_RUN
        while t < end:
            k, r0 = t // bs, t % bs
            if r0 or end - t < bs:  # a partial block
                r1 = min(bs, end - k * bs)
                yield self.words[table[k] : table[k] + 1], [k], r0, r1
                t = k * bs + r1
                continue
            k1 = k + 1  # the run of consecutive block ids from k, within the whole blocks
            while k1 < end // bs and table[k1] == table[k1 - 1] + 1:
                k1 += 1
            if k1 - k >= MIN_RUN:
                yield self.words[table[k] : table[k1 - 1] + 1], list(range(k, k1)), 0, bs
            else:
                gather += range(k, k1)
            t = k1 * bs
        per = max(1, GATHER_BYTES // self.block_bytes)
        for i in range(0, len(gather), per):
            ks = gather[i : i + per]
            idx = torch.tensor([table[k] for k in ks], dtype=torch.long).to(self.words.device, non_blocking=True)
            yield self.words.index_select(0, idx), ks, 0, bs

    def _piece(self, x: torch.Tensor, ks: list[int], r0: int, g: int) -> torch.Tensor:
        """[s1, s2] of x [m, regions, heads, rows, words], block i being table index ks[i], row 0 being r0."""
        m, regions, heads, rows, words = x.shape
        dev = x.device
        kj = words
        kr = heads * kj
        kt = regions * kr
        y = x.sum(-1, dtype=torch.int64)  # [m, regions, heads, rows]
        per_word = x.sum((0, 1, 2, 3), dtype=torch.int64)  # [words]
        s1 = y.sum()
        t_k = torch.tensor(ks, dtype=torch.int64).to(dev, non_blocking=True) * self.block_size  # block's first token

        def dot(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (v * w).sum()

        ar = lambda n, start=0: torch.arange(start, start + n, dtype=torch.int64, device=dev)  # noqa: E731
        s2 = (
            s1 * (1 + g * KG)
            + kt * (dot(y.sum((1, 2, 3)), t_k) + dot(y.sum((0, 1, 2)), ar(rows, r0)))
            + kr * dot(y.sum((0, 2, 3)), ar(regions))
            + kj * dot(y.sum((0, 1, 3)), ar(heads))
            + dot(per_word, ar(words))
        )
        return torch.stack([s1, s2])


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run on a CUDA stream (and its device) when one is given; a no-op on the CPU."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield
