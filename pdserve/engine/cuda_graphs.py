"""CUDA graphs of the decode step: one captured graph per batch-size bucket, replayed over static buffers.

A decode step (every row one new token) of the fused decoder is ~10 kernels per layer; launched one by one
from Python that is several milliseconds of launch overhead per step, more than the GPU work of a small
batch. Captured once per bucket (1, 2, 4, 8, 16, 24, 32, 48, 64 rows), a step is one graph launch.

Static inputs live in one int64 device buffer, filled each step by a single host->device copy from a pinned
staging buffer: [input_ids | positions | context_lens | slot_mapping of each KV group] (bucket-max rows each)
followed by the block tables ([max_rows, num_groups, max_blocks_per_seq], row-major: a bucket's rows are one
prefix of the buffer). A model with several KV groups (kv/groups.py: sliding-window layers) gets one
AttentionContext per group, each its own slots and a strided view of its tables. Padding rows of a bucket
get slot -1 (their K/V is not stored) and context length 0 (their attention output is zero); their logits
are ignored. Invariants: a row's block-table entries past ceil(context_len / block_size) are never read, nor
(windowed group) those before the block holding its window's first key, so stale entries may stay; a
layer's window is fixed, so the captured kernels' arguments stay valid; a row still owned by the same
request keeps its staged entries and only new blocks are written (blocks of a running request never change,
except that a windowed group's may turn STALE, never read; after an eager step, which is where a preempted
request recomputes, the worker calls invalidate()); the pinned staging buffer is reused only after the
previous step's logits were read (the sampler syncs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.engine.tp.step_plan import Chunk
from pdserve.model.decoder import Decoder
from pdserve.model.paged import AttentionContext, DecodeBatch, cache_block_size

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class DecodeGraphs:
    """Captures decode steps of `decoder` over `kv_cache` and replays the smallest bucket that fits a batch."""

    def __init__(
        self,
        decoder: Decoder,
        kv_cache: torch.Tensor,  # [num_blocks, layers per block, 2, num_kv_heads, block_size, head_dim]
        max_blocks_per_seq: int,  # width of the static block tables; longer sequences run eagerly
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache
        self.block_size = cache_block_size(kv_cache)
        self.buckets = tuple(sorted(buckets))
        self.max_rows = self.buckets[-1]
        self.width = max_blocks_per_seq
        self.num_groups = decoder.kv_groups.num_groups
        device = kv_cache.device
        r, g = self.max_rows, self.num_groups
        n = (3 + g) * r + r * g * self.width
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._ids, self._pos, self._lens = (self._dev[i * r : (i + 1) * r] for i in range(3))
        self._slots = self._dev[3 * r : (3 + g) * r].view(g, r)  # [groups, max_rows]
        self._tables = self._dev[(3 + g) * r :].view(r, g, self.width)  # [max_rows, groups, width]
        self._rows = torch.arange(r, dtype=torch.int64, device=device)
        self._slots_np = self._host_np[3 * r : (3 + g) * r].reshape(g, r)
        self._tables_np = self._host_np[(3 + g) * r :].reshape(r, g, self.width)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, logits)
        self._row_owner: list[str | None] = []  # request id whose block table row i of the staging buffer holds
        self._row_blocks: list[int] = []  # entries of that row already staged
        self.gemv_calibration: dict[int, float] = {}  # Decoder.gemv_max_rows -> ms of a one-row step
        self.replays = 0  # steps run from a captured graph
        self.invalidate()

    def can_run(self, chunks: Sequence[Chunk]) -> bool:
        """All rows single-token, few enough rows, every block table narrow enough."""
        if not chunks or len(chunks) > self.max_rows:
            return False
        return all(len(c.token_ids) == 1 and c.start_pos // self.block_size < self.width for c in chunks)

    def _forward(self, rows: int) -> torch.Tensor:
        ctxs = [
            AttentionContext(
                self._slots[g, :rows],
                [],
                DecodeBatch(
                    rows=self._rows[:rows],
                    block_tables=self._tables[:rows, g],  # [rows, width], row stride groups * width
                    context_lens=self._lens[:rows],
                    max_context_len=self.width * self.block_size,
                ),
                self.block_size,
            )
            for g in range(self.num_groups)
        ]
        ctx = ctxs[0] if self.num_groups == 1 else ctxs
        hidden = self.decoder(self._ids[:rows], self._pos[:rows], self.kv_cache, ctx)  # [rows, hidden]
        return self.decoder.logits(hidden)  # [rows, vocab] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool (a few hundred ms; Triton compiles first).

        Before that, for one row, times a captured step with cuBLAS and with the Triton GEMV and keeps the
        faster (Decoder.gemv_max_rows); the timings stay in gemv_calibration."""
        self._host_np[:] = 0
        self._slots_np[:] = -1  # store nothing
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

    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Replay the step for these chunks (can_run must hold); returns logits [len(chunks), vocab] float32.

        Chunks of rank 0 (ScheduledChunk) carry their request id, so a row still held by the same request
        stages only its new blocks; a tensor-parallel rank's plan chunks carry none and stage whole rows."""
        n = len(chunks)
        rows = next(b for b in self.buckets if b >= n)
        r, bs, g = self.max_rows, self.block_size, self.num_groups
        h = self._host_np
        pos = [c.start_pos for c in chunks]
        h[0:n] = [c.token_ids[0] for c in chunks]
        h[r : r + n] = pos
        h[2 * r : 2 * r + n] = [p + 1 for p in pos]
        h[2 * r + n : 3 * r] = 0
        for group in range(g):
            slots = self._slots_np[group]
            slots[:n] = [c.block_tables[group][p // bs] * bs + p % bs for c, p in zip(chunks, pos, strict=True)]
            slots[n:] = -1
        # block tables: a row keeps its request's entries between steps; only new blocks are staged
        owner, written, tables = self._row_owner, self._row_blocks, self._tables_np
        for i, c in enumerate(chunks):
            num_blocks = pos[i] // bs + 1
            start = written[i]
            request_id = c.request_id if isinstance(c, ScheduledChunk) else None  # TP ranks' chunks: None
            if request_id is None or owner[i] != request_id or start > num_blocks or self._changed(i, c, start - 1):
                start = 0  # another request (or the same id with other blocks): stage the whole row
            if start < num_blocks:
                for group in range(g):
                    tables[i, group, start:num_blocks] = c.block_tables[group][start:num_blocks]
            owner[i], written[i] = request_id, num_blocks
        end = (3 + g) * r + rows * g * self.width
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        graph, logits = self._graphs[rows]
        graph.replay()
        self.replays += 1
        return logits[:n]

    def _changed(self, row: int, chunk: Chunk, entry: int) -> bool:
        """Whether the staged table entry `entry` of `row` (the last one staged) differs from the chunk's in
        any group (a windowed group's entry that turned STALE counts: the row is staged again, harmlessly)."""
        return entry >= 0 and any(
            self._tables_np[row, group, entry] != table[entry] for group, table in enumerate(chunk.block_tables)
        )


def max_blocks_per_seq(kv_cache: torch.Tensor, max_position_embeddings: int) -> int:
    """Block-table width of the graphs: the model's longest sequence, at most every block of the cache."""
    num_blocks, block_size = kv_cache.shape[0], cache_block_size(kv_cache)
    return min(num_blocks, -(-max_position_embeddings // block_size))
