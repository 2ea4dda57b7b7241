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
needs no weight tensor: it combines marginal sums (per block, row, region, head, word) reduced in two passes
over views of the cache: no copy for a run of consecutive blocks (what the block pool hands out), a gather in
bounded chunks otherwise, where the cache lives. A GPU cache is summed by a Triton kernel (checksum_kernel.py;
torch's reductions without Triton) on a side stream of the transfer thread, and only six int64 terms per KV
group reach the host (no host copy of VRAM KV); a CPU cache by numpy's vectorised reductions over the same
memory. Addition and multiplication mod 2^64 are associative and commutative, so CPU and GPU, and any
reduction order, agree to the bit. Not a MAC: it
catches corruption in transit, not an adversary (the deployment secret guards the side channel).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
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
        self.host_words: Any = None if kv.is_cuda else self.words.numpy()  # the same memory, for numpy's reductions
        self.block_bytes = raw[0].numel()
        self.stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self.kernel: Any = None
        if kv.is_cuda:
            try:
                from pdserve.transfer.checksum_kernel import terms

                self.kernel = terms
            except ImportError:  # no Triton: torch's reductions
                pass

    def part(
        self, tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]], head0: int, num_heads: int
    ) -> list[int]:
        """[s1, s2] over tokens ranges[g] of tables[g] for every KV group g, heads [head0, head0 + num_heads)."""
        if not (num_heads >= 1 and 0 <= head0 and head0 + num_heads <= self.num_heads):
            raise ValueError(f"heads [{head0}, {head0 + num_heads}) outside this cache's {self.num_heads}")
        if len(tables) != len(ranges):
            raise ValueError(f"{len(tables)} block tables for {len(ranges)} token ranges")
        with _on(self.stream):  # (the copy of the two sums to the host synchronizes the stream)
            return self._sum(tables, ranges, head0, num_heads)

    def flip_byte(self, table: Sequence[int], token: int, head: int) -> None:
        """Test fault (Faults.flip_kv_byte): flip one bit of the first byte of token's row of `head`, layer 0, K."""
        b, row = table[token // self.block_size], token % self.block_size
        with _on(self.stream):
            self.raw[b, 0, 0, head, row, :1].bitwise_xor_(1)
            if self.stream is not None:
                self.stream.synchronize()

    def _sum(
        self, tables: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]], head0: int, num_heads: int
    ) -> list[int]:
        """[s1, s2]: per KV group g, the pieces' marginal terms (_terms) are added up on the device (int64, mod
        2^64), then combined on the host: s2 = sum over g of t0 (1 + g KG) + KT (bs t1 + t2) + KR t3 + KJ t4 + t5."""
        words = self.words.shape[-1]
        kj, kr, kt = words, num_heads * words, self.words.shape[1] * num_heads * words
        groups = []
        for table, (first, end) in zip(tables, ranges, strict=True):
            acc: Any = None
            for blocks, ks, r0, r1 in self._pieces(table, first, end):
                t = self._terms(blocks[:, :, head0 : head0 + num_heads, r0:r1], ks, r0)
                acc = t if acc is None else acc + t
            groups.append([0] * 6 if acc is None else [int(v) for v in acc.tolist()])  # (one host copy per group)
        s1 = s2 = 0
        for g, (t0, t1, t2, t3, t4, t5) in enumerate(groups):
            s1 += t0
            s2 += t0 * (1 + g * KG) + kt * (self.block_size * t1 + t2) + kr * t3 + kj * t4 + t5
        return [_signed(s1), _signed(s2)]

    def _pieces(self, table: Sequence[int], first: int, end: int) -> Iterator[tuple[Any, list[int], int, int]]:
        """(words of some blocks [m, regions, heads, block_size, words], their table indices, rows [r0, r1))
        covering tokens [first, end) of one table: partial blocks alone, whole blocks by runs (views) or gathers
        (copies of at most GATHER_BYTES)."""
        bs, t = self.block_size, first
        words: Any = self.host_words if self.stream is None else self.words
        gather: list[int] = []  # table indices of whole blocks in runs shorter than MIN_RUN
        while t < end:
            k, r0 = t // bs, t % bs
            if r0 or end - t < bs:  # a partial block
                r1 = min(bs, end - k * bs)
                yield words[table[k] : table[k] + 1], [k], r0, r1
                t = k * bs + r1
                continue
            k1 = k + 1  # the run of consecutive block ids from k, within the whole blocks
            while k1 < end // bs and table[k1] == table[k1 - 1] + 1:
                k1 += 1
            if k1 - k >= MIN_RUN:
                yield words[table[k] : table[k1 - 1] + 1], list(range(k, k1)), 0, bs
            else:
                gather += range(k, k1)
            t = k1 * bs
        per = max(1, GATHER_BYTES // self.block_bytes)
        for i in range(0, len(gather), per):
            ks = gather[i : i + per]
            ids = [table[k] for k in ks]
            if self.stream is None:
                yield words[ids], ks, 0, bs
            else:
                idx = torch.tensor(ids, dtype=torch.long).to(self.words.device, non_blocking=True)
                yield words.index_select(0, idx), ks, 0, bs

    def _terms(self, x: Any, ks: list[int], r0: int) -> Any:
        """Six int64 marginal terms of x [m, regions, heads, rows, words] (block i: table index ks[i]; row 0: r0):
        [sum x, sum_b k_b Y_b, sum_row row Y_row, sum_r r Y_r, sum_j j Y_j, sum_i i X_i], mod 2^64. On the CPU
        by numpy (its int32 -> int64 reductions ran ~5x faster than torch's here), on CUDA by torch."""
        m, regions, heads, rows, words = x.shape
        if self.stream is None:
            y = x.sum(-1, dtype=np.int64)  # [m, regions, heads, rows]
            per_word = x.sum((0, 1, 2, 3), dtype=np.int64)  # [words]
            ar: Any = lambda n, start=0: np.arange(start, start + n, dtype=np.int64)  # noqa: E731
            vec: Any = np.array
            k: Any = np.array(ks, dtype=np.int64)
        elif self.kernel is not None:  # CUDA: one read of the piece (checksum_kernel.py)
            return self.kernel(x, ks, r0)
        else:  # CUDA without Triton: two torch reductions (slower: checksum_kernel.py says by how much)
            y = x.sum(-1, dtype=torch.int64)
            per_word = x.sum((0, 1, 2, 3), dtype=torch.int64)
            dev = x.device
            ar = lambda n, start=0: torch.arange(start, start + n, dtype=torch.int64, device=dev)  # noqa: E731
            vec, k = torch.stack, torch.tensor(ks, dtype=torch.int64).to(dev, non_blocking=True)
        return vec(
            [
                y.sum(),
                (y.sum((1, 2, 3)) * k).sum(),
                (y.sum((0, 1, 2)) * ar(rows, r0)).sum(),
                (y.sum((0, 2, 3)) * ar(regions)).sum(),
                (y.sum((0, 1, 3)) * ar(heads)).sum(),
                (per_word * ar(words)).sum(),
            ]
        )


def _signed(v: int) -> int:
    """v mod 2^64 as a signed int64 (what msgpack carries)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run on a CUDA stream (and its device) when one is given; a no-op on the CPU."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield
