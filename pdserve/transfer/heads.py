"""Tensor-parallel KV head ranges: which rank holds which KV heads, and which producer rank sends which heads to
which consumer rank (pure Python: the scheduler halves, the transfer thread and the tests use it).

A model with H KV heads on T ranks (model/parallel.py, shard_for) gives rank r
    heads [r * H / T, (r + 1) * H / T)   when H % T == 0 (split), or
    head  r // (T / H)                   when T % H == 0 (T / H ranks replicate each head).
P (P_T ranks) and D (D_T ranks) of one model map at transfer time: D rank d needs its heads; each head h comes
from one P rank holding it — the only one when P splits, else replica (d mod P_T / H) of h's P ranks, so that
replicated heads spread their sending over P's ranks. Consecutive heads from one P rank are one HeadSlice.
Every D rank registers with (push) or releases to (pull) every P rank, so each P rank knows when the request is
over for it even when it sends nothing; a D rank counts exactly len(sources(...)) completions (push: PushDone).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """Heads [head_start, head_start + num_heads) of the model that one producer rank sends one consumer rank."""

    producer_rank: int  # P's rank that sends them
    head_start: int  # first KV head of the model
    num_heads: int
    producer_offset: int  # index of head_start among the producer rank's heads
    consumer_offset: int  # index of head_start among the consumer rank's heads


def rank_heads(total_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) held by `rank` of `tp_size` (model/parallel.py's shard_for)."""
    if total_heads % tp_size == 0:
        n = total_heads // tp_size
        return rank * n, n
    return rank // (tp_size // total_heads), 1


def mapping_error(p_heads: int, p_tp: int, d_heads: int, d_tp: int) -> str | None:
    """None when P (p_tp ranks of a model with p_heads KV heads) can send to D, else why, naming both sides."""
    both = f"prefill TP {p_tp} with {p_heads} KV heads, decode TP {d_tp} with {d_heads} KV heads"
    if p_heads != d_heads:
        return f"KV head counts differ ({both})"
    for side, tp in (("prefill", p_tp), ("decode", d_tp)):
        if tp < 1 or (p_heads % tp and tp % p_heads):
            return f"{side} TP {tp} neither splits nor replicates the KV heads ({both})"
    return None


def sources(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[HeadSlice]:
    """The head slices D rank d receives, one per run of consecutive heads from one P rank, in head order."""
    d_start, d_num = rank_heads(total_heads, d_tp, d_rank)
    out: list[HeadSlice] = []
    for h in range(d_start, d_start + d_num):
        if total_heads % p_tp == 0:
            p = h // (total_heads // p_tp)
        else:
            replicas = p_tp // total_heads
            p = h * replicas + d_rank % replicas
        p_start, _ = rank_heads(total_heads, p_tp, p)
        last = out[-1] if out else None
        if last is not None and last.producer_rank == p and last.head_start + last.num_heads == h:
            out[-1] = HeadSlice(p, last.head_start, last.num_heads + 1, last.producer_offset, last.consumer_offset)
        else:
            out.append(HeadSlice(p, h, 1, h - p_start, h - d_start))
    return out


def num_producers(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> int:
    """Producer ranks that send D rank d anything: the completions it counts."""
    return len({s.producer_rank for s in sources(total_heads, p_tp, d_tp, d_rank)})
