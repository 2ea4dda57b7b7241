"""Bring up what LLMEngine computes with: rank 0's model and KV cache, and the other tensor-parallel ranks.

Lives apart from the engine because it is the one part of starting an engine that can fail half way with
processes already running: the ranks (group.py) are shut down here if loading or allocating fails, and
handed to the engine, which owns them and joins them in shutdown(), once everything is up. Rank 0 brings up
its own compute with the same bring_up_rank (bring_up.py) as every other rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.tp.bring_up import RankCompute, bring_up_rank
from pdserve.engine.tp.group import TPGroup
from pdserve.model.loader import model_arch
from pdserve.model.parallel import check_tp_split
from pdserve.transfer.faults import NO_FAULTS, Faults


@dataclass(frozen=True)
class RankZero:
    """Rank 0's loaded model and KV cache, and the ranks 1..tp-1 that are ready with theirs."""

    compute: RankCompute  # rank 0's model and cache (compute.num_blocks: the same on every rank)
    ranks: TPGroup | None  # ranks 1..tp-1, None at TP 1; the engine owns them and joins them in shutdown()


def start_rank_zero(config: EngineConfig, faults: Faults = NO_FAULTS) -> RankZero:
    """Start the other ranks (TP > 1), load rank 0's model and allocate its cache, then wait for the ranks to
    be ready with as many blocks. On any failure the ranks are shut down before the error propagates."""
    tp = config.parallel.tensor_parallel_size
    ranks: TPGroup | None = None
    if tp > 1:
        check_tp_split(model_arch(config.model), tp)
        ranks = TPGroup(config, faults)
    try:
        comm = None if ranks is None else ranks.connect()
        compute = bring_up_rank(config, 0, comm)
        if ranks is not None:
            ranks.wait_ready(compute.num_blocks)
    except BaseException:
        if ranks is not None:
            ranks.shutdown()
        raise
    return RankZero(compute, ranks)
