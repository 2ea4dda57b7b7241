"""Sliding-window attention on the CUDA path (cuda/attention.py) against the portable path (attention.py),
float32, tiny shapes: head dims 16/32, block sizes 4/16, windows 5/8/16 (and 100: several decode splits),
contexts past the window, a batch of mixed lengths, GQA groups 1/2/4.

On an H200: `pytest -m gpu tests/gpu/test_windowed_attention.py`. Without a GPU the same tests run on CPU
tensors under Triton's interpreter (a development aid, slow; CI has no Triton):
`TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_windowed_attention.py`.

Cache rows a windowed query must not see hold NaN in the copy the CUDA path reads: a key read from them, or a
table entry read before the window's first block (set to -1, STALE, there), would poison the output.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.model.attention import paged_attention
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan, layer_view

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1"),
]


class Paged:
    """A block-major cache [num_blocks, 3 layers, 2, hkv, bs, d] (layer 1 is used: kernels must take the
    strides) with shuffled blocks, filled for sequences of the given lengths."""

    def __init__(self, lens: list[int], bs: int, hkv: int, d: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bs, self.lens = bs, lens
        num_blocks = sum(-(-n // bs) for n in lens) + 3
        full = torch.randn(num_blocks, 3, 2, hkv, bs, d, generator=gen)
        self.full = full.to(DEVICE)
        self.cache = layer_view(self.full, 1)  # [2, num_blocks, bs, hkv, d], strided
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]

    def table(self, i: int) -> torch.Tensor:
        return torch.tensor(self.tables[i], device=DEVICE)

    def kv_of(self, i: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of sequence i at positions [start, end): [end - start, hkv, d] each."""
        pos = torch.arange(start, end, device=DEVICE)
        blocks, rows = self.table(i)[pos // self.bs], pos % self.bs
        return self.cache[0][blocks, rows], self.cache[1][blocks, rows]

    def poisoned(self, seen_from: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """(a copy of the layer cache with NaN at every position < seen_from[i] of sequence i, tables with -1
        before the block of seen_from[i]): what a windowed group looks like once old blocks are freed."""
        full = self.full.clone()
        cache = layer_view(full, 1)
        tables = []
        for i, lo in enumerate(seen_from):
            for p in range(lo):
                cache[:, self.tables[i][p // self.bs], p % self.bs] = float("nan")
            tables.append([-1 if j < lo // self.bs else b for j, b in enumerate(self.tables[i])])
        return cache, tables


def _decode_batch(tables: list[list[int]], lens: list[int], rows: torch.Tensor) -> DecodeBatch:
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    return DecodeBatch(rows, bt, torch.tensor(lens, device=DEVICE), max(lens))


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("window", [5, 8, 16, 100, None])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_portable(head_dim: int, bs: int, window: int | None, group: int) -> None:
    from pdserve.model.cuda.attention import decode_attention

    hkv = 2
    h = hkv * group
    lens = [1, 4, 5, 9, 17, 33, 130, 301]  # within, at and well past every window
    paged = Paged(lens, bs, hkv, head_dim, seed=head_dim + bs + group)
    rows = torch.arange(len(lens), device=DEVICE) * 2 + 1  # decode rows interleaved with other rows
    q = torch.randn(2 * len(lens) + 1, h, head_dim, device=DEVICE)
    batch = _decode_batch(paged.tables, lens, rows)
    ctx = AttentionContext(rows[:0], [], batch, bs)
    ref = paged_attention(q, paged.cache, ctx, 0.25, window=window, cpu_kernel=False)  # portable
    seen_from = [0 if window is None else max(0, n - window) for n in lens]
    cache, tables = paged.poisoned(seen_from)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, _decode_batch(tables, lens, rows), 0.25, out, window)
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=1e-4)
    assert out[0].isnan().all()  # rows not in the batch untouched


@pytest.mark.parametrize("window", [5, 8, 16])
@pytest.mark.parametrize("offset", [0, 3, 21])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_matches_portable(window: int, offset: int, group: int) -> None:
    """A prompt with nothing cached (offset 0) and a chunk after cached tokens, tiled in 8-row tiles (bands
    and band-free tiles both occur), over a cache whose entries before the first visible block are STALE."""
    from pdserve.model.cuda.attention import prefill_attention

    bs, hkv, d, nq = 4, 2, 16, 29
    n = offset + nq
    paged = Paged([n], bs, hkv, d, seed=window + offset)
    q = torch.randn(nq, hkv * group, d, device=DEVICE)
    k, v = paged.kv_of(0, offset, n)
    span = PrefillSpan(0, nq, n, paged.table(0))
    slots = paged.table(0).repeat_interleave(bs)[offset:n] * bs + torch.arange(offset, n, device=DEVICE) % bs
    ctx = AttentionContext(slots, [span], None, bs)
    ref = paged_attention(q, paged.cache, ctx, 0.25, None, None, window, False)  # no k, v: portable on CUDA too
    cache, tables = paged.poisoned([max(0, offset - window + 1)])
    stale_span = PrefillSpan(0, nq, n, torch.tensor(tables[0], device=DEVICE))
    for tile in (8, 1024):
        out = prefill_attention(q, k, v, cache, stale_span, 0.25, window, tile)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [5, None])
def test_mixed_step_matches_portable(window: int | None) -> None:
    """One step holding a prompt, a chunk after cached tokens and two decode rows (paged_attention_cuda)."""
    from pdserve.model.cuda.attention import paged_attention_cuda

    bs, hkv, group, d = 4, 2, 2, 32
    lens, new = [12, 30, 19, 41], [12, 7, 1, 1]  # context after the step, new tokens this step
    paged = Paged(lens, bs, hkv, d, seed=7)
    starts = [0, 12, 19, 20]  # rows of each sequence's new tokens
    t = sum(new)
    q = torch.randn(t, hkv * group, d, device=DEVICE)
    k = torch.empty(t, hkv, d, device=DEVICE)
    v = torch.empty_like(k)
    for i in range(4):
        k[starts[i] : starts[i] + new[i]], v[starts[i] : starts[i] + new[i]] = paged.kv_of(i, lens[i] - new[i], lens[i])
    spans = [PrefillSpan(starts[i], new[i], lens[i], paged.table(i)) for i in (0, 1)]
    rows = torch.tensor(starts[2:], device=DEVICE)
    decode = _decode_batch(paged.tables[2:], lens[2:], rows)
    ctx = AttentionContext(torch.zeros(t, dtype=torch.long, device=DEVICE), spans, decode, bs)
    ref = paged_attention(q, paged.cache, ctx, 0.25, None, None, window, False)  # portable
    out = paged_attention_cuda(q, k, v, paged.cache, ctx, 0.25, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
