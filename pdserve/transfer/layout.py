"""Layout math: block ids and a token range -> byte regions of two KV caches (pure math, no torch, no NIXL).

Both caches are laid out as [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. A (layer, K/V)
pair is a *region* of num_blocks * block_size tokens; token t of a request lives in region r at
    base_addr + r * region_stride + block_ids[t // block_size] * block_bytes + (t % block_size) * token_bytes.
A transfer of tokens [start, start + n) is cut at every block boundary of *both* sides (so P and D may use
different block sizes), giving segments whose offsets are the same in every region; segments (and then
whole descriptors) that are contiguous on both sides are merged into one descriptor.
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
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def region_stride(self) -> int:
        """Bytes between consecutive (layer, K/V) regions."""
        return self.num_blocks * self.block_bytes

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers


@dataclass(frozen=True)
class Segment:
    """A run of tokens contiguous on both sides; offsets are bytes from the start of a region."""

    local_offset: int
    remote_offset: int
    length: int  # bytes


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
    """Segments covering tokens [start_token, start_token + num_tokens), cut at both sides' block boundaries
    and merged where contiguous on both sides."""
    if local.token_bytes != remote.token_bytes:
        raise LayoutError(f"token size differs: local {local.token_bytes} B, remote {remote.token_bytes} B")
    if start_token < 0 or num_tokens < 0:
        raise LayoutError(f"bad token range: start {start_token}, count {num_tokens}")
    end = start_token + num_tokens
    check_blocks(local, local_block_ids, end, "local")
    check_blocks(remote, remote_block_ids, end, "remote")
    tb, lbs, rbs = local.token_bytes, local.block_size, remote.block_size
    segments: list[Segment] = []
    t = start_token
    while t < end:
        stop = min(end, (t // lbs + 1) * lbs, (t // rbs + 1) * rbs)
        lo = local_block_ids[t // lbs] * local.block_bytes + (t % lbs) * tb
        ro = remote_block_ids[t // rbs] * remote.block_bytes + (t % rbs) * tb
        n = (stop - t) * tb
        last = segments[-1] if segments else None
        if last and last.local_offset + last.length == lo and last.remote_offset + last.length == ro:
            segments[-1] = Segment(last.local_offset, last.remote_offset, last.length + n)
        else:
            segments.append(Segment(lo, ro, n))
        t = stop
    return segments


def descriptors(local: BlockLayout, remote: BlockLayout, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor arrays for the segments in every region: two [num_descs, 3] uint64 arrays of
    (address, length, device id), row i of one matching row i of the other. Rows contiguous on both sides
    (a segment ending a region and the next region's first one) are merged."""
    if local.num_layers != remote.num_layers:
        raise LayoutError(f"layer count differs: local {local.num_layers}, remote {remote.num_layers}")
    if not segments:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    regions = np.arange(local.num_regions, dtype=np.int64)[:, None]  # [num_regions, 1]
    lo = np.array([s.local_offset for s in segments], dtype=np.int64)[None, :]  # [1, num_segments]
    ro = np.array([s.remote_offset for s in segments], dtype=np.int64)[None, :]
    length = np.array([s.length for s in segments], dtype=np.int64)
    l_addr = (local.base_addr + regions * local.region_stride + lo).ravel()  # [num_regions * num_segments]
    r_addr = (remote.base_addr + regions * remote.region_stride + ro).ravel()
    lens = np.tile(length, local.num_regions)
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
    return layout.num_regions * sum(s.length for s in segments)
