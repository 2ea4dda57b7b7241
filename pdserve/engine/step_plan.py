"""The step plan rank 0 sends to the other tensor-parallel ranks: what to compute this step, as int64 words.

Every rank builds the same AttentionContext from the same plan (ModelRunner.forward), so the ranks' forward
passes line up collective for collective. Only what the model needs crosses: token ids, start positions,
the block ids covering each chunk's context, and which chunks sample (their rows' logits are gathered).
Request ids and sampling parameters stay on rank 0, which alone samples.

Encoding (explicit, no pickle): one little-endian int64 array
    [PLAN_VERSION, kind, num_chunks,
     num_chunks x (num_tokens, start_pos, num_blocks, sample),
     every chunk's token ids, then every chunk's block ids]
A SHUTDOWN message is [PLAN_VERSION, SHUTDOWN, 0]. decode() checks every length and refuses anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np

PLAN_VERSION = 1  # 1: first version (chunks of token ids, start positions, block ids, sample flags)
HEADER_WORDS = 3
WORDS_PER_CHUNK = 4


class PlanKind(IntEnum):
    STEP = 1  # run the model on the chunks
    SHUTDOWN = 2  # leave the rank loop (no chunks)


class Chunk(Protocol):
    """What ModelRunner.forward reads of a chunk (engine/scheduler.py's ScheduledChunk has these fields)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_tables(self) -> Sequence[Sequence[int]]: ...
    @property
    def sample(self) -> bool: ...


@dataclass(frozen=True)
class PlanChunk:
    """One request's tokens for this step, as the other ranks see it."""

    token_ids: list[int]  # tokens at positions [start_pos, start_pos + len)
    start_pos: int  # tokens of the request already in the KV cache
    block_ids: list[int]  # the request's blocks covering [0, start_pos + len) tokens
    sample: bool  # the chunk ends the request's input: its last row's logits are computed (and gathered)

    @property
    def block_tables(self) -> list[list[int]]:
        """One KV group: tensor parallelism serves models of one group only (engine.py refuses others)."""
        return [self.block_ids]


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind
    chunks: list[PlanChunk]  # empty for SHUTDOWN


class PlanError(ValueError):
    """A message that is not a step plan of this version."""


def plan_of(chunks: Sequence[Chunk], block_size: int) -> StepPlan:
    """The plan for rank 0's scheduled chunks (only the block ids the step reads)."""
    out = []
    for c in chunks:
        n = len(c.token_ids)
        num_blocks = -(-(c.start_pos + n) // block_size)
        out.append(PlanChunk(list(c.token_ids), c.start_pos, list(c.block_tables[0][:num_blocks]), c.sample))
    return StepPlan(PlanKind.STEP, out)


SHUTDOWN = StepPlan(PlanKind.SHUTDOWN, [])


def encode(plan: StepPlan) -> bytes:
    header = [PLAN_VERSION, int(plan.kind), len(plan.chunks)]
    per_chunk = [x for c in plan.chunks for x in (len(c.token_ids), c.start_pos, len(c.block_ids), int(c.sample))]
    tokens = [t for c in plan.chunks for t in c.token_ids]
    blocks = [b for c in plan.chunks for b in c.block_ids]
    return np.asarray(header + per_chunk + tokens + blocks, dtype="<i8").tobytes()


def decode(data: bytes) -> StepPlan:
    """The plan in `data`; PlanError naming what is wrong otherwise."""
    if len(data) % 8 or len(data) < 8 * HEADER_WORDS:
        raise PlanError(f"step plan of {len(data)} bytes is not a whole header of int64 words")
    words = np.frombuffer(data, dtype="<i8")
    version, kind, num_chunks = (int(x) for x in words[:HEADER_WORDS])
    if version != PLAN_VERSION:
        raise PlanError(f"step plan version {version}, this rank speaks {PLAN_VERSION}")
    if kind not in (PlanKind.STEP, PlanKind.SHUTDOWN):
        raise PlanError(f"unknown step plan kind {kind}")
    meta_end = HEADER_WORDS + WORDS_PER_CHUNK * num_chunks
    if num_chunks < 0 or meta_end > len(words):
        raise PlanError(f"step plan announces {num_chunks} chunks but has {len(words)} words")
    meta = words[HEADER_WORDS:meta_end].reshape(num_chunks, WORDS_PER_CHUNK).tolist()
    num_tokens = sum(m[0] for m in meta)
    num_blocks = sum(m[2] for m in meta)
    if any(m[0] < 1 or m[1] < 0 or m[2] < 1 for m in meta) or meta_end + num_tokens + num_blocks != len(words):
        raise PlanError(
            f"step plan lengths do not add up ({num_tokens} tokens, {num_blocks} blocks, {len(words)} words)"
        )
    tokens = words[meta_end : meta_end + num_tokens].tolist()
    blocks = words[meta_end + num_tokens :].tolist()
    chunks, t, b = [], 0, 0
    for n, start, nb, sample in meta:
        chunks.append(PlanChunk(tokens[t : t + n], start, blocks[b : b + nb], bool(sample)))
        t, b = t + n, b + nb
    return StepPlan(PlanKind(kind), chunks)
