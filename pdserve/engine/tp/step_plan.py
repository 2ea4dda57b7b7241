"""The step plan rank 0 sends to the other tensor-parallel ranks: what to compute this step, as int64 words.

Every rank builds the same AttentionContext from the same plan (ModelRunner.forward), so the ranks' forward
passes line up collective for collective. Only what the model needs crosses: token ids, start positions,
every KV group's block ids covering each chunk's context (kv/groups.py: one group for most models; a
windowed group's entries before its window are STALE, -1, and cross as such: the runner builds one context per
group from them and never reads those), and which chunks sample (their rows' logits are gathered). Request ids
and sampling parameters stay on rank 0, which alone samples.

Encoding (explicit, no pickle): one little-endian int64 array
    [PLAN_VERSION, kind, num_chunks,
     num_chunks x (num_tokens, start_pos, num_groups, num_blocks, sample),
     every chunk's token ids, then every chunk's block ids (group by group: num_groups x num_blocks each)]
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

from pdserve.kv.groups import STALE

# 1: first version (chunks of token ids, start positions, block ids, sample flags); 2: TRANSFER (a StepMeta);
# 3: a block table per KV group (num_groups per chunk; STALE entries) (sliding-window / hybrid models)
PLAN_VERSION = 3
HEADER_WORDS = 3
WORDS_PER_CHUNK = 5


class PlanKind(IntEnum):
    STEP = 1  # run the model on the chunks
    SHUTDOWN = 2  # leave the rank loop (no chunks)
    TRANSFER = 3  # hand the payload (a StepMeta, transfer/ranks.py) to the rank's ConnectorWorker


class Chunk(Protocol):
    """What ModelRunner.forward reads of a chunk (engine/scheduler_output.py's ScheduledChunk has these fields)."""

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
    # per KV group, the request's blocks covering [0, start_pos + len) tokens (all of one length; a windowed
    # group's entries before its window may be STALE)
    block_tables: list[list[int]]
    sample: bool  # the chunk ends the request's input: its last row's logits are computed (and gathered)


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind
    chunks: list[PlanChunk]  # empty for SHUTDOWN and TRANSFER
    payload: bytes = b""  # TRANSFER: the encoded StepMeta


class PlanError(ValueError):
    """A message that is not a step plan of this version."""


def plan_of(chunks: Sequence[Chunk], block_size: int) -> StepPlan:
    """The plan for rank 0's scheduled chunks: every KV group's table, cut to the blocks the step reads."""
    out = []
    for c in chunks:
        n = len(c.token_ids)
        num_blocks = -(-(c.start_pos + n) // block_size)
        tables = [list(t[:num_blocks]) for t in c.block_tables]
        out.append(PlanChunk(list(c.token_ids), c.start_pos, tables, c.sample))
    return StepPlan(PlanKind.STEP, out)


SHUTDOWN = StepPlan(PlanKind.SHUTDOWN, [])


def encode(plan: StepPlan) -> bytes:
    if plan.kind == PlanKind.TRANSFER:
        return np.asarray([PLAN_VERSION, int(plan.kind), 0], dtype="<i8").tobytes() + plan.payload
    header = [PLAN_VERSION, int(plan.kind), len(plan.chunks)]
    per_chunk: list[int] = []
    for c in plan.chunks:
        num_blocks = len(c.block_tables[0]) if c.block_tables else 0
        if any(len(t) != num_blocks for t in c.block_tables):
            raise PlanError(f"a chunk's KV group tables differ in length ({[len(t) for t in c.block_tables]})")
        per_chunk += [len(c.token_ids), c.start_pos, len(c.block_tables), num_blocks, int(c.sample)]
    tokens = [t for c in plan.chunks for t in c.token_ids]
    blocks = [b for c in plan.chunks for t in c.block_tables for b in t]
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
    num_blocks = sum(m[2] * m[3] for m in meta)
    if any(m[0] < 1 or m[1] < 0 or m[2] < 1 or m[3] < 1 for m in meta) or (
        meta_end + num_tokens + num_blocks != len(words)
    ):
        raise PlanError(
            f"step plan lengths do not add up ({num_tokens} tokens, {num_blocks} blocks, {len(words)} words)"
        )
    tokens = words[meta_end : meta_end + num_tokens].tolist()
    block_words = words[meta_end + num_tokens :]
    if len(block_words) and int(block_words.min()) < STALE:
        raise PlanError(f"step plan block id {int(block_words.min())} is neither a block nor STALE ({STALE})")
    blocks = block_words.tolist()
    chunks, t, b = [], 0, 0
    for n, start, num_groups, nb, sample in meta:
        tables = [blocks[b + g * nb : b + (g + 1) * nb] for g in range(num_groups)]
        chunks.append(PlanChunk(tokens[t : t + n], start, tables, bool(sample)))
        t, b = t + n, b + num_groups * nb
    return StepPlan(PlanKind(kind), chunks)
