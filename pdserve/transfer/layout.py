"""Layout math: block ids and a token range -> byte regions of two KV caches (pure math, no torch, no NIXL).

Both caches are block-major: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]. One block's K and
V of every layer are one contiguous range of block_stride = num_regions * region_bytes bytes, where a *region*
is one (layer, K/V) pair (num_regions = 2 * num_layers) and region_bytes = block_size * token_bytes. Token t
of a request lives, in region r, at
    base_addr + block_ids[t // block_size] * block_stride + r * region_bytes + (t % block_size) * token_bytes.
A transfer of tokens [start, start + n) is cut at every block boundary of *both* sides (so P and D may use
different block sizes) into segments, each inside one local and one remote block. A segment that is a whole
block on both sides is one descriptor of block_stride bytes (every layer at once); any other segment (a partial
first or last block, or different block sizes) is one descriptor per region, so the bytes of tokens outside
the range are never touched. Descriptors contiguous on both sides (runs of whole blocks) are merged: with
equal block sizes a transfer is one descriptor per run of blocks contiguous on both sides, whatever the
number of layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.transfer.base import KVCacheSpec


class LayoutError(ValueError):
    """A transfer does not fit the blocks it names (bad block id, too few blocks, token-size mismatch)."""


@dataclass(frozen=True)
class BlockLayout:
    """Where one instance's KV bytes are: enough to turn (block ids, tokens) into addresses."""

    base_addr: int  # address of element 0 of the KV cache
    num_layers: int
    num_blocks: int
    block_size: int  # tokens per block
    token_bytes: int  # bytes of one token's K (or V) in one layer
    device_id: int = 0  # NIXL device id of the buffer (GPU index; 0 for DRAM)

    @classmethod
    def from_spec(cls, spec: KVCacheSpec) -> BlockLayout:
        return cls(spec.base_addr, spec.num_layers, spec.num_blocks, spec.block_size, spec.token_bytes, spec.device_id)

    @property
    def region_bytes(self) -> int:
        """Bytes of one (layer, K/V) region of one block: block_size tokens."""
        return self.block_size * self.token_bytes

    @property
    def block_stride(self) -> int:
        """Bytes of one block (K and V of every layer), the distance between consecutive blocks."""
        return self.num_regions * self.region_bytes

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers


@dataclass(frozen=True)
class Segment:
    """Tokens inside one local block and one remote block (the same tokens on both sides)."""

    local_block: int  # block id
    local_row: int  # first token's row in that block
    remote_block: int
    remote_row: int
    num_tokens: int


def check_blocks(layout: BlockLayout, block_ids: Sequence[int], end_token: int, side: str) -> None:
    """Raise LayoutError unless block_ids are valid and cover tokens [0, end_token)."""
    need = -(-end_token // layout.block_size)
    if len(block_ids) < need:
        raise LayoutError(
            f"{side} has {len(block_ids)} blocks of {layout.block_size} tokens, {need} needed for {end_token} tokens"
        )
    for b in block_ids[:need]:
        if not 0 <= b < layout.num_blocks:
            raise LayoutError(f"{side} block id {b} is outside [0, {layout.num_blocks})")


def token_segments(
    local: BlockLayout,
    local_block_ids: Sequence[int],
    remote: BlockLayout,
    remote_block_ids: Sequence[int],
    start_token: int,
    num_tokens: int,
) -> list[Segment]:
    """Segments covering tokens [start_token, start_token + num_tokens), cut at both sides' block boundaries."""
    if local.token_bytes != remote.token_bytes:
        raise LayoutError(f"token size differs: local {local.token_bytes} B, remote {remote.token_bytes} B")
    if start_token < 0 or num_tokens < 0:
        raise LayoutError(f"bad token range: start {start_token}, count {num_tokens}")
    end = start_token + num_tokens
    check_blocks(local, local_block_ids, end, "local")
    check_blocks(remote, remote_block_ids, end, "remote")
    lbs, rbs = local.block_size, remote.block_size
    segments: list[Segment] = []
    t = start_token
    while t < end:
        stop = min(end, (t // lbs + 1) * lbs, (t // rbs + 1) * rbs)
        segments.append(Segment(local_block_ids[t // lbs], t % lbs, remote_block_ids[t // rbs], t % rbs, stop - t))
        t = stop
    return segments


def descriptors(local: BlockLayout, remote: BlockLayout, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor arrays for the segments: two [num_descs, 3] uint64 arrays of (address, length, device
    id), row i of one matching row i of the other. A whole block on both sides is one row; any other segment
    is one row per region. Rows contiguous on both sides are merged."""
    if local.num_layers != remote.num_layers:
        raise LayoutError(f"layer count differs: local {local.num_layers}, remote {remote.num_layers}")
    if not segments:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    seg = np.array(
        [(s.local_block, s.local_row, s.remote_block, s.remote_row, s.num_tokens) for s in segments], dtype=np.int64
    )  # [num_segments, 5]
    lb, lr, rb, rr, n = seg.T
    whole = (lr == 0) & (rr == 0) & (n == local.block_size) & (n == remote.block_size)  # [num_segments]
    counts = np.where(whole, 1, local.num_regions)  # rows per segment
    idx = np.repeat(np.arange(len(seg)), counts)  # [num_rows]: the segment of each row
    region = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)  # 0 for a whole block's row
    tb = local.token_bytes
    l_addr = local.base_addr + lb[idx] * local.block_stride + region * local.region_bytes + lr[idx] * tb
    r_addr = remote.base_addr + rb[idx] * remote.block_stride + region * remote.region_bytes + rr[idx] * tb
    lens = np.where(whole[idx], local.block_stride, n[idx] * tb)
    # a new descriptor starts where either side is not contiguous with the previous row
    starts = np.ones(len(lens), dtype=bool)
    starts[1:] = (l_addr[:-1] + lens[:-1] != l_addr[1:]) | (r_addr[:-1] + lens[:-1] != r_addr[1:])
    group = np.cumsum(starts) - 1
    merged_len = np.bincount(group, weights=lens).astype(np.int64)
    first = np.flatnonzero(starts)

    def table(addr: np.ndarray, device_id: int) -> np.ndarray:
        out = np.empty((len(first), 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr[first], merged_len, device_id
        return out

    return table(l_addr, local.device_id), table(r_addr, remote.device_id)


def num_bytes(layout: BlockLayout, segments: list[Segment]) -> int:
    """Bytes a transfer of these segments moves (all regions)."""
    return layout.num_regions * layout.token_bytes * sum(s.num_tokens for s in segments)
