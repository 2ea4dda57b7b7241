"""CUDA graphs of the decode step: one captured graph per batch-size bucket, replayed over static buffers.

A decode step (every row one new token) of the fused decoder is ~10 kernels per layer; launched one by one
from Python that is several milliseconds of launch overhead per step, more than the GPU work of a small
batch. Captured once per bucket (1, 2, 4, 8, 16, 24, 32, 48, 64 rows), a step is one graph launch.

Static inputs live in one int64 device buffer, filled each step by a single host->device copy from a pinned
staging buffer: [input_ids | positions | slot_mapping | context_lens] (bucket-max rows each) followed by the
block tables ([max_rows, max_blocks_per_seq], row-major). Padding rows of a bucket get slot -1 (their K/V is
not stored) and context length 0 (their attention output is zero); their logits are ignored. Invariants:
a row's block-table entries past ceil(context_len / block_size) are never read, so stale entries may stay;
a row still owned by the same request keeps its staged entries and only new blocks are written (blocks of a
running request never change; after an eager step, which is where a preempted request recomputes, the
worker calls invalidate()); the pinned staging buffer is reused only after the previous step's logits were
read (the sampler syncs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.engine.scheduler import ScheduledChunk
from pdserve.model.decoder import Decoder
from pdserve.model.paged import AttentionContext, DecodeBatch, cache_block_size

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class DecodeGraphs:
    """Captures decode steps of `decoder` over `kv_cache` and replays the smallest bucket that fits a batch."""

    def __init__(
        self,
        decoder: Decoder,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        max_blocks_per_seq: int,  # width of the static block tables; longer sequences run eagerly
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache
        self.block_size = cache_block_size(kv_cache)
        self.buckets = tuple(sorted(buckets))
        self.max_rows = self.buckets[-1]
        self.width = max_blocks_per_seq
        device = kv_cache.device
        n = 4 * self.max_rows + self.max_rows * self.width
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        r = self.max_rows
        self._ids, self._pos, self._slots, self._lens = (self._dev[i * r : (i + 1) * r] for i in range(4))
        self._tables = self._dev[4 * r :].view(r, self.width)
        self._rows = torch.arange(r, dtype=torch.int64, device=device)
        self._tables_np = self._host_np[4 * r :].reshape(r, self.width)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, logits)
        self._row_owner: list[str | None] = []  # request id whose block table row i of the staging buffer holds
        self._row_blocks: list[int] = []  # entries of that row already staged
        self.gemv_calibration: dict[int, float] = {}  # Decoder.gemv_max_rows -> ms of a one-row step
        self.invalidate()

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        """All rows single-token, few enough rows, every block table narrow enough."""
        if not chunks or len(chunks) > self.max_rows:
            return False
        return all(len(c.token_ids) == 1 and c.start_pos // self.block_size < self.width for c in chunks)

    def _forward(self, rows: int) -> torch.Tensor:
        decode = DecodeBatch(
            rows=self._rows[:rows],
            block_tables=self._tables[:rows],
            context_lens=self._lens[:rows],
            max_context_len=self.width * self.block_size,
        )
        ctx = AttentionContext(self._slots[:rows], [], decode, self.block_size)
        hidden = self.decoder(self._ids[:rows], self._pos[:rows], self.kv_cache, ctx)  # [rows, hidden]
        return self.decoder.logits(hidden)  # [rows, vocab] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool (a few hundred ms; Triton compiles first).

        Before that, for one row, times a captured step with cuBLAS and with the Triton GEMV and keeps the
        faster (Decoder.gemv_max_rows); the timings stay in gemv_calibration."""
        r = self.max_rows
        self._host_np[:] = 0
        self._host_np[2 * r : 3 * r] = -1  # slots: store nothing
        self._dev.copy_(self._host)
        if 1 in self.buckets:
            self._calibrate_gemv()
        pool = torch.cuda.graph_pool_handle()
        self._warm_up(reversed(self.buckets))
        for rows in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(rows)
            self._graphs[rows] = (graph, logits)
        torch.cuda.synchronize()

    def _warm_up(self, buckets: Iterable[int]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows in buckets:
                self._forward(rows)  # compiles (and autotunes) kernels, settles allocations
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _calibrate_gemv(self, replays: int = 10) -> None:
        for setting in (0, 1):
            self.decoder.gemv_max_rows = setting
            self._warm_up([1])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._forward(1)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            self.gemv_calibration[setting] = start.elapsed_time(end) / replays
            del graph
        cublas, gemv = self.gemv_calibration[0], self.gemv_calibration[1]
        self.decoder.gemv_max_rows = 1 if gemv < 0.99 * cublas else 0

    def invalidate(self) -> None:
        """Forget which block-table rows are already staged (call after any step that did not replay a graph:
        a preempted request may come back under the same id with other blocks)."""
        self._row_owner = [None] * self.max_rows
        self._row_blocks = [0] * self.max_rows

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Replay the step for these chunks (can_run must hold); returns logits [len(chunks), vocab] float32."""
        n = len(chunks)
        rows = next(b for b in self.buckets if b >= n)
        r, bs = self.max_rows, self.block_size
        h = self._host_np
        pos = [c.start_pos for c in chunks]
        h[0:n] = [c.token_ids[0] for c in chunks]
        h[r : r + n] = pos
        h[2 * r : 2 * r + n] = [c.block_ids[p // bs] * bs + p % bs for c, p in zip(chunks, pos, strict=True)]
        h[2 * r + n : 3 * r] = -1
        h[3 * r : 3 * r + n] = [p + 1 for p in pos]
        h[3 * r + n : 4 * r] = 0
        # block tables: a row keeps its request's entries between steps; only new blocks are staged
        owner, written, tables = self._row_owner, self._row_blocks, self._tables_np
        for i, c in enumerate(chunks):
            num_blocks = pos[i] // bs + 1
            start = written[i]
            if owner[i] != c.request_id or start > num_blocks or tables[i, start - 1] != c.block_ids[start - 1]:
                start = 0  # another request (or the same id with other blocks): stage the whole row
            if start < num_blocks:
                tables[i, start:num_blocks] = c.block_ids[start:num_blocks]
            owner[i], written[i] = c.request_id, num_blocks
        end = 4 * r + rows * self.width
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        graph, logits = self._graphs[rows]
        graph.replay()
        return logits[:n]


def max_blocks_per_seq(kv_cache: torch.Tensor, max_position_embeddings: int) -> int:
    """Block-table width of the graphs: the model's longest sequence, at most every block of the cache."""
    num_blocks, block_size = kv_cache.shape[0], cache_block_size(kv_cache)
    return min(num_blocks, -(-max_position_embeddings // block_size))
