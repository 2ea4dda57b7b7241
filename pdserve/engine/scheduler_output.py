"""The scheduler's output: the chunks a step computes (the contract between scheduler and model runner).

Lives apart from the scheduler because its readers are elsewhere (engine.py, runner.py, cuda_graphs.py) and
none of them needs the scheduling policy; pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """Tokens of one request to compute in this step (the worker's input for that request)."""

    request_id: str
    token_ids: list[int]  # tokens at positions [start_pos, start_pos + len)
    start_pos: int  # = the request's num_computed_tokens before this step
    block_tables: list[list[int]]  # the request's blocks per KV group (covering start_pos + len tokens)
    sample: bool  # this chunk ends at the request's last token: sample the next one
    params: SamplingParams
    num_output_tokens: int  # generated so far (sampling seed step)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's blocks (all of them for a one-group model)."""
        return self.block_tables[0]


@dataclass
class SchedulerOutput:
    """One step's plan: what to compute, and what the scheduler did to make room."""

    chunks: list[ScheduledChunk] = field(default_factory=list)  # running requests first, then new ones
    preempted_ids: list[str] = field(default_factory=list)
    out_of_blocks: list[Request] = field(default_factory=list)  # alone and still no block: finish ("length")

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, every chunk together."""
        return sum(len(c.token_ids) for c in self.chunks)
