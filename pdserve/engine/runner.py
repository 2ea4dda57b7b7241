"""ModelRunner: owns the model and the KV cache tensor; runs one batch per call.

The engine drives it through one call, execute(chunks) -> sampled tokens. The KV connector's worker half is
the engine's, not this class's: the engine registers the same cache tensor with it.

Tensor parallelism: on rank 0 `ranks` (engine/tp/group.py) is the group of the other ranks; execute() sends
them the step's plan (engine/tp/step_plan.py) before running forward() on the same chunks, and every rank's
forward() runs the same collectives. Rank 0 alone samples. Any failure of a tensor-parallel step is a
TPGroupError: the ranks may no longer be in step, so the group is unusable from then on.

On CUDA (fused decoder) steps whose rows are all single-token decodes replay a captured CUDA graph
(cuda_graphs.py), sliding-window models included (one context per KV group; a layer's window is fixed, so
its captured decode kernel stays valid); everything else runs eagerly. Both give the same tokens.

CUDA graphs with tensor parallelism: every rank captures the same buckets in the same order over its own KV
slice, the NCCL all-reduces inside each captured step included (model/cuda/nccl.py: a communicator of our own on
the current stream). Rank 0 captures after TPGroup.wait_ready() and the other ranks right after saying ready,
so the captures' collectives meet. Whether a step replays a graph (and which bucket) is a function of the
chunks alone (DecodeGraphs.can_run), and every rank gets the same chunks in the plan, so every rank replays
the same graph or every rank runs eagerly; both paths go through step_logits().
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from pdserve.engine.sampler import sample
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.engine.tp.step_plan import Chunk, StepPlan, plan_of
from pdserve.model.cpu import kernels as cpu_kernels
from pdserve.model.decoder import Decoder
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan, cache_block_size

if TYPE_CHECKING:
    from pdserve.engine.cuda_graphs import DecodeGraphs

T = TypeVar("T")


class StepRanks(Protocol):
    """What rank 0's runner needs of the other tensor-parallel ranks (engine/tp/group.py's TPGroup); named here
    so that the runner, which every rank runs, does not import the group that spawns the ranks."""

    def run_step(self, plan: StepPlan, forward: Callable[[Sequence[Chunk]], T]) -> T:
        """Send `plan` to every rank, then run rank 0's `forward` on its chunks; TPGroupError on any failure."""
        ...

    def check(self) -> None:
        """Raise TPGroupError if the group broke during the step."""
        ...


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        kv_cache: torch.Tensor,
        device: torch.device,
        use_cuda_graphs: bool = True,
        ranks: StepRanks | None = None,  # rank 0 of a tensor-parallel instance: the other ranks
        max_model_len: int | None = None,  # longest sequence served (sizes the graphs' block tables)
    ) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, num_kv_heads of this rank, block_size, head_dim]
        self.block_size = cache_block_size(kv_cache)
        self.device = device
        self.ranks = ranks
        self.graphs: DecodeGraphs | None = None  # CUDA only: captured decode steps
        if device.type == "cpu" and decoder.use_cpu_kernel:
            cpu_kernels.library()  # build it now (seconds, once per machine), not in the first step
        if use_cuda_graphs and decoder.uses_fused_kernels(device):
            from pdserve.engine.cuda_graphs import DecodeGraphs, max_blocks_per_seq

            width = max_blocks_per_seq(kv_cache, max_model_len or decoder.arch.max_position_embeddings)
            self.graphs = DecodeGraphs(decoder, kv_cache, width)
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Compute KV for every chunk's tokens and sample the next token of chunks that end a request's input."""
        if self.ranks is None:
            logits = self.step_logits(chunks)
        else:
            logits = self.ranks.run_step(plan_of(chunks, self.block_size), lambda _: self.step_logits(chunks))
        sampling = [c for c in chunks if c.sample]
        if logits is None:
            return {}
        tokens = sample(logits, [c.params for c in sampling], [c.num_output_tokens for c in sampling])
        if self.ranks is not None:
            self.ranks.check()  # a rank died during the step: its collectives were aborted, the logits are junk
        return {c.request_id: t for c, t in zip(sampling, tokens, strict=True)}

    @torch.inference_mode()
    def step_logits(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """The step on this rank: a captured graph's replay when one fits, else forward(); logits [N, vocab] of
        the N sampling chunks (chunk order), None when none samples. Every tensor-parallel rank calls it with
        the same chunks and so takes the same path."""
        if self.graphs is not None:
            if self.graphs.can_run(chunks):
                logits = self.graphs.run(chunks)  # [len(chunks), vocab] float32, row i = chunk i
                rows = [i for i, c in enumerate(chunks) if c.sample]
                if not rows:
                    return None
                return logits if len(rows) == len(chunks) else logits[rows]
            self.graphs.invalidate()
        return self.forward(chunks)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """One forward pass over the chunks: logits [N, vocab] float32 of the N sampling chunks' last rows (in
        chunk order), None when no chunk samples. Every tensor-parallel rank calls it with the same chunks."""
        ctx, input_ids, positions, sample_rows = self._prepare(chunks)
        hidden = self.decoder(input_ids, positions, self.kv_cache, ctx)  # [T, hidden]
        if not sample_rows:
            return None
        rows = torch.tensor(sample_rows, device=self.device)
        return self.decoder.logits(hidden.index_select(0, rows))  # [N, vocab] float32

    def _prepare(
        self, chunks: Sequence[Chunk]
    ) -> tuple[AttentionContext | list[AttentionContext], torch.Tensor, torch.Tensor, list[int]]:
        """The step's inputs: one AttentionContext, or one per KV group (kv/groups.py) when the model has
        several; token ids [T], positions [T], and the rows whose logits are sampled."""
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
            if c.sample:
                sample_rows.append(len(ids) - 1)
        num_groups = self.decoder.kv_groups.num_groups
        ctxs = [self._context(chunks, g, len(ids)) for g in range(num_groups)]
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return (ctxs[0] if num_groups == 1 else ctxs), t(ids), t(pos), sample_rows

    def _context(self, chunks: Sequence[Chunk], group: int, num_rows: int) -> AttentionContext:
        """The AttentionContext of one KV group: its slots and block tables (a windowed group's STALE entries
        before the window are never read, model/attention.py)."""
        bs = self.block_size
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        row0 = 0
        for c in chunks:
            start, n = c.start_pos, len(c.token_ids)
            blocks = c.block_tables[group]
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx_len = start + n
            table = list(blocks[: -(-ctx_len // bs)])
            if n == 1:
                dec_rows.append(row0)
                dec_tables.append(table)
                dec_lens.append(ctx_len)
            else:
                prefills.append(PrefillSpan(row0, n, ctx_len, torch.tensor(table, device=self.device)))
            row0 += n
        decode = None
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            padded = [t + [0] * (width - len(t)) for t in dec_tables]
            decode = DecodeBatch(
                rows=torch.tensor(dec_rows, device=self.device),
                block_tables=torch.tensor(padded, device=self.device),
                context_lens=torch.tensor(dec_lens, device=self.device),
                max_context_len=max(dec_lens),
                is_uniform=min(dec_lens) == max(dec_lens),
                rows_are_all=len(dec_rows) == num_rows,
            )
        return AttentionContext(
            slot_mapping=torch.tensor(slots, device=self.device), prefills=prefills, decode=decode, block_size=bs
        )
