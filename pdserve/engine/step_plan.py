"""The step plan rank 0 sends to the other tensor-parallel ranks: what to compute this step, as int64 words.

Every rank builds the same AttentionContext from the same plan (ModelRunner.forward), so the ranks' forward
passes line up collective for collective. Only what the model needs crosses: token ids, start positions,
the block ids covering each chunk's context, and which chunks sample (their rows' logits are gathered).
Request ids and sampling parameters stay on rank 0, which alone samples.

Encoding (explicit, no pickle): one little-endian int64 array
    [PLAN_VERSION, kind, num_chunks,
     num_chunks x (num_tokens, start_pos, num_blocks, sample),
     every chunk's token ids, then every chunk's block ids]
A SHUTDOWN message is [PLAN_VERSION, SHUTDOWN, 0]; a TRANSFER message is [PLAN_VERSION, TRANSFER, 0] followed by
the connector's StepMeta as bytes (transfer/ranks.py), for the rank's own ConnectorWorker. decode() checks every
length and refuses anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np

# 1: first version (chunks of token ids, start positions, block ids, sample flags); 2: TRANSFER (a StepMeta)
PLAN_VERSION = 2
HEADER_WORDS = 3
WORDS_PER_CHUNK = 4


class PlanKind(IntEnum):
    STEP = 1  # run the model on the chunks
    SHUTDOWN = 2  # leave the rank loop (no chunks)
    TRANSFER = 3  # hand the payload (a StepMeta, transfer/ranks.py) to the rank's ConnectorWorker


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
    chunks: list[PlanChunk]  # empty for SHUTDOWN and TRANSFER
    payload: bytes = b""  # TRANSFER: the encoded StepMeta


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
    if plan.kind == PlanKind.TRANSFER:
        return np.asarray([PLAN_VERSION, int(plan.kind), 0], dtype="<i8").tobytes() + plan.payload
    header = [PLAN_VERSION, int(plan.kind), len(plan.chunks)]
    per_chunk = [x for c in plan.chunks for x in (len(c.token_ids), c.start_pos, len(c.block_ids), int(c.sample))]
    tokens = [t for c in plan.chunks for t in c.token_ids]
    blocks = [b for c in plan.chunks for b in c.block_ids]
    return np.asarray(header + per_chunk + tokens + blocks, dtype="<i8").tobytes()


def decode(data: bytes) -> StepPlan:
    """The plan in `data`; PlanError naming what is wrong otherwise."""
    if len(data) < 8 * HEADER_WORDS:
        raise PlanError(f"step plan of {len(data)} bytes is shorter than its header")
    version, kind, _ = (int(x) for x in np.frombuffer(data[: 8 * HEADER_WORDS], dtype="<i8"))
    if version == PLAN_VERSION and kind == PlanKind.TRANSFER:
        return StepPlan(PlanKind.TRANSFER, [], data[8 * HEADER_WORDS :])
    if len(data) % 8:
        raise PlanError(f"step plan of {len(data)} bytes is not whole int64 words")
    words = np.frombuffer(data, dtype="<i8")
    version, kind, num_chunks = (int(x) for x in words[:HEADER_WORDS])
    if version != PLAN_VERSION:
        raise PlanError(f"step plan version {version}, this rank speaks {PLAN_VERSION}")
    if kind not in (PlanKind.STEP, PlanKind.SHUTDOWN, PlanKind.TRANSFER):
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
