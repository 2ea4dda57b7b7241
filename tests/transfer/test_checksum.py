"""transfer/checksum.py: the KV checksum agrees across block sizes, block ids, head slices and runs vs gathers
wherever both sides hold the same tokens, and changes with one flipped byte, two swapped rows or blocks, and
a head or group off by one. Also on CUDA when present (the CPU and GPU sums agree to the bit)."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer import checksum
from pdserve.transfer.checksum import KVChecksum

LAYERS, HEAD_DIM = 3, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _fill(tokens: torch.Tensor, block_size: int, table: list[int], num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache [num_blocks, layers, 2, heads, block_size, head_dim] holding tokens [n, layers, 2, heads, head_dim]
    at the table's blocks (other rows: noise)."""
    n, _, _, heads, _ = tokens.shape
    kv = torch.randn(num_blocks, LAYERS, 2, heads, block_size, HEAD_DIM).to(dtype)
    for t in range(n):
        kv[table[t // block_size], :, :, :, t % block_size] = tokens[t]
    return kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_bytes_equal_sums_across_layouts(device: str, dtype: torch.dtype) -> None:
    n = 70
    tokens = torch.randn(n, LAYERS, 2, 4, HEAD_DIM).to(dtype)
    p_table = list(range(3, 3 + 5))  # 16-token blocks, one run
    d_table = [9, 2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 5, 6, 7, 8, 11, 12, 13, 14, 15]  # 4-token blocks, scattered
    p = KVChecksum(_fill(tokens, 16, p_table, 10, dtype).to(device))
    d = KVChecksum(_fill(tokens[:, :, :, 1:3], 4, d_table, 40, dtype).to(device))  # D holds heads 1, 2 of P's
    for first, end in [(0, n), (16, 69), (5, 6), (36, 52)]:
        want = p.part([p_table], [(first, end)], 1, 2)
        assert d.part([d_table], [(first, end)], 0, 2) == want
        assert want != p.part([p_table], [(first, end)], 0, 2)  # another head slice
        assert want != p.part([p_table, p_table], [(0, 0), (first, end)], 1, 2)  # another KV group
    # a gather (scattered blocks) and a view (a run) give the same sums
    assert d.part([d_table], [(8, 48)], 0, 2) == p.part([p_table], [(8, 48)], 1, 2)
    assert KVChecksum(_fill(tokens, 16, p_table, 10, dtype)).part([p_table], [(0, n)], 1, 2) == p.part(
        [p_table], [(0, n)], 1, 2
    )  # CPU == device
    if device == "cuda":  # the Triton kernel (checksum_kernel.py) == torch's reductions == numpy
        want = p.part([p_table], [(5, 69)], 1, 2)
        p.kernel = None
        assert p.part([p_table], [(5, 69)], 1, 2) == want


def test_detects_a_flip_a_swap_and_a_misplaced_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "MIN_RUN", 2)
    tokens = torch.randn(64, LAYERS, 2, 2, HEAD_DIM)
    table = [0, 1, 2, 3]
    kv = _fill(tokens, 16, table, 6, torch.float32)
    ck = KVChecksum(kv)
    want = ck.part([table], [(0, 63)], 0, 2)
    ck.flip_byte(table, 40, 1)
    assert ck.part([table], [(0, 63)], 0, 2) != want
    ck.flip_byte(table, 40, 1)  # flipped back
    assert ck.part([table], [(0, 63)], 0, 2) == want
    ck.flip_byte(table, 63, 1)  # a row outside the range (what D computes itself) is not covered
    assert ck.part([table], [(0, 63)], 0, 2) == want
    rows = kv[1, :, :, :, [3, 4]].clone()
    kv[1, :, :, :, [4, 3]] = rows  # two token rows swapped: same words, other places
    assert ck.part([table], [(0, 63)], 0, 2)[0] == want[0]
    assert ck.part([table], [(0, 63)], 0, 2) != want
    kv[1, :, :, :, [3, 4]] = rows
    assert ck.part([table], [(0, 63)], 0, 2) == want
    kv[4] = kv[2]  # the same bytes read from another block (a wrong table entry)
    assert ck.part([[0, 1, 4, 3]], [(0, 63)], 0, 2) == want
    kv[[1, 2]] = kv[[2, 1]].clone()  # two blocks' contents swapped
    assert ck.part([table], [(0, 63)], 0, 2) != want


def test_bad_heads_are_refused() -> None:
    ck = KVChecksum(torch.zeros(2, LAYERS, 2, 2, 4, HEAD_DIM))
    with pytest.raises(ValueError, match="outside"):
        ck.part([[0]], [(0, 4)], 1, 2)
