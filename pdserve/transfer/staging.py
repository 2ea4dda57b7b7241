"""kv_buffer_device "cpu": NIXL moves a host mirror of the KV cache; the KV cache itself stays on the GPU.

For fabrics without GPUDirect. The mirror has the KV cache's block-major shape [num_blocks, num_layers, 2,
num_kv_heads, block_size, head_dim] (pinned host memory) and is what NIXL registers (as DRAM) and what the
handshake describes; block b of the mirror (one contiguous range) stages block b of the KV cache. Copies go by
block id on a dedicated CUDA stream and are synchronized before anyone may rely on them:

- P, pull: `stage_out` on the engine thread inside NixlWorker.submit(), before the SendTask is posted. The
  engine returns a step's outputs (P's response carrying the pull coordinates) only after that step's
  submit(), so the blocks are in the mirror before D can know where to READ (D's READ is one-sided: P could
  not delay it). The staging stream first waits for the engine's stream (the prefill that wrote the blocks).
- P, push: submit() records a CUDA event on the engine's stream; the transfer thread's `stage_out` (just
  before posting the WRITE, exactly the blocks it covers) waits for it, then synchronizes.
- D (both modes): after the data landed in the mirror (READ DONE / every PushDone), `stage_in` copies exactly
  the received tokens mirror -> KV cache on the transfer thread and synchronizes; only then is the recv
  reported finished. Nothing the transfer writes touches the KV cache before that.
Pinned blocks (P) and blocks awaiting KV (D) are used by no one else, so their mirror blocks are too.

Cache already on the CPU: "cpu" registers the cache in place (no stager), unless a test's Faults has
force_staging (a plain host mirror, so CPU tests exercise the copies and their moment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.transfer.base import KVCacheSpec
from pdserve.transfer.faults import NO_FAULTS, Faults


def token_blocks(block_ids: Sequence[int], block_size: int, start: int, num_tokens: int) -> list[tuple[int, int, int]]:
    """(block id, first token, end token) within that block for tokens [start, start + num_tokens)."""
    out: list[tuple[int, int, int]] = []
    t, end = start, start + num_tokens
    while t < end:
        stop = min(end, (t // block_size + 1) * block_size)
        out.append((block_ids[t // block_size], t % block_size, t % block_size + stop - t))
        t = stop
    return out


class Stager:
    """The mirror and the copies between it and the KV cache (thread-safe for disjoint blocks)."""

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self.kv = kv_cache
        self.device = kv_cache.device
        self.cuda = kv_cache.device.type == "cuda"
        self.mirror = torch.empty(kv_cache.shape, dtype=kv_cache.dtype, pin_memory=self.cuda)
        self.block_size = spec.geometry.block_size  # tokens per block of the cache and its mirror
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready: Any = None  # push: the newest CUDA event recorded on the engine's stream by submit()

    def spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """What NIXL registers and the handshake describes: the mirror."""
        return dataclasses.replace(spec, base_addr=self.mirror.data_ptr(), memory="DRAM", device_id=0)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def mark_ready(self) -> None:
        """Engine thread, P (push): what the engine queued so far has written the blocks of the sends posted next."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._ready = ev

    # ---- copies -----------------------------------------------------------------------------------------------
    def stage_out(self, block_ids: Sequence[int], start: int, num_tokens: int, engine_thread: bool = False) -> None:
        """KV cache -> mirror for tokens [start, start + num_tokens) (whole blocks); returns when done."""
        blocks = sorted({b for b, _, _ in token_blocks(block_ids, self.block_size, start, num_tokens)})
        if not blocks:
            return
        if not self.cuda:
            idx = torch.tensor(blocks, dtype=torch.long)
            self.mirror.index_copy_(0, idx, self.kv.index_select(0, idx))
            return
        assert self.stream is not None
        if engine_thread:  # after what the engine's stream has queued (the prefill that wrote these blocks)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        elif self._ready is not None:  # transfer thread: after the event submit() recorded before posting
            self.stream.wait_event(self._ready)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            idx = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
            gathered = self.kv.index_select(0, idx)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
        self.stream.synchronize()
        self.mirror.index_copy_(0, torch.tensor(blocks, dtype=torch.long), host)

    def stage_in(self, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        """Mirror -> KV cache for exactly tokens [start, start + num_tokens); returns when done."""
        parts = token_blocks(block_ids, self.block_size, start, num_tokens)
        whole = [b for b, t0, t1 in parts if t0 == 0 and t1 == self.block_size]
        partial = [(b, t0, t1) for b, t0, t1 in parts if not (t0 == 0 and t1 == self.block_size)]
        if not parts:
            return
        if not self.cuda:
            if whole:
                idx = torch.tensor(whole, dtype=torch.long)
                self.kv.index_copy_(0, idx, self.mirror.index_select(0, idx))
            for b, t0, t1 in partial:
                self.kv[b, :, :, :, t0:t1] = self.mirror[b, :, :, :, t0:t1]  # [layers, 2, heads, rows, d]
            return
        assert self.stream is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if whole:
                idx = torch.tensor(whole, dtype=torch.long)
                host = torch.empty((len(whole), *self.mirror.shape[1:]), dtype=self.mirror.dtype, pin_memory=True)
                torch.index_select(self.mirror, 0, idx, out=host)
                self.kv.index_copy_(0, idx.to(self.device), host.to(self.device, non_blocking=True))
            for b, t0, t1 in partial:
                self.kv[b, :, :, :, t0:t1].copy_(self.mirror[b, :, :, :, t0:t1].contiguous().to(self.device))
        self.stream.synchronize()


def make_stager(kv_buffer_device: str, kv_cache: Any, spec: KVCacheSpec, faults: Faults = NO_FAULTS) -> Stager | None:
    """A Stager when transfers must go through host memory, else None (register the KV cache in place)."""
    if not isinstance(kv_cache, torch.Tensor):
        return None
    if faults.force_staging:
        return Stager(kv_cache, spec)
    if kv_buffer_device == "cpu" and kv_cache.device.type == "cuda":
        return Stager(kv_cache, spec)
    return None
