"""Bring up what LLMEngine computes with: rank 0's model and KV cache, and the other tensor-parallel ranks.

Lives apart from the engine because it is the one part of starting an engine that can fail half way with
processes already running: the ranks (engine/tp_group.py) are shut down here if loading or allocating fails,
and handed to the engine, which owns them and joins them in shutdown(), once everything is up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import allocate_kv_cache, num_blocks_for
from pdserve.engine.tp_group import TPGroup
from pdserve.engine.tp_rank import rank_device
from pdserve.model.loader import LoadedModel, load_model, model_arch
from pdserve.model.parallel import check_tp_split


@dataclass(frozen=True)
class RankZero:
    """Rank 0's loaded model and KV cache, and the ranks 1..tp-1 that are ready with theirs."""

    loaded: LoadedModel  # rank 0's decoder (its shard at TP > 1), tokenizer and architecture
    kv_cache: torch.Tensor  # rank 0's cache (kv_cache.allocate_kv_cache), of num_blocks blocks
    num_blocks: int  # blocks of the cache, the same on every rank
    device: torch.device  # where rank 0 computes
    ranks: TPGroup | None  # ranks 1..tp-1, None at TP 1; the engine owns them and joins them in shutdown()


def start_rank_zero(config: EngineConfig) -> RankZero:
    """Start the other ranks (TP > 1), load rank 0's model and allocate its cache, then wait for the ranks to
    be ready with as many blocks. On any failure the ranks are shut down before the error propagates."""
    tp = config.parallel.tensor_parallel_size
    ranks: TPGroup | None = None
    if tp > 1:
        check_tp_split(model_arch(config.model), tp)
        ranks = TPGroup(config)
    try:
        comm = None if ranks is None else ranks.connect()
        device_name = rank_device(config.model.device, 0) if tp > 1 else config.model.device
        loaded = load_model(config.model, tp, 0, comm, device_name)
        dtype = getattr(torch, config.model.dtype)
        device = torch.device(device_name)
        kv_heads = loaded.decoder.shard.num_kv_heads  # this rank's
        num_blocks = num_blocks_for(config.cache, loaded.arch, dtype, kv_heads)
        kv_cache = allocate_kv_cache(loaded.arch, num_blocks, config.cache.block_size, dtype, device, kv_heads)
        if ranks is not None:
            ranks.wait_ready(num_blocks)
    except BaseException:
        if ranks is not None:
            ranks.shutdown()
        raise
    return RankZero(loaded, kv_cache, num_blocks, device, ranks)
