"""Bring up one tensor-parallel rank's compute: its device, its shard of the model and its KV cache slice.

The one bring-up every rank runs: rank 0 in its engine's process (rank_zero.py), ranks 1..N-1 in their spawned
processes (rank.py). Every rank computes its block count the same way from the same config, and rank 0 checks
that the others agree (TPGroup.wait_ready).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import allocate_kv_cache, num_blocks_for
from pdserve.model.loader import TORCH_DTYPES, LoadedModel, load_model
from pdserve.model.parallel import Collectives


@dataclass(frozen=True)
class RankCompute:
    """One rank's loaded model and KV cache."""

    loaded: LoadedModel  # this rank's decoder (its shard at TP > 1) and architecture; the tokenizer on rank 0 only
    kv_cache: torch.Tensor  # this rank's cache (kv_cache.allocate_kv_cache), of num_blocks blocks
    num_blocks: int  # blocks of the cache, the same on every rank
    device: torch.device  # where this rank computes


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s torch device: the CPU for every rank, or the rank-th GPU counted from `device`'s."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def device_of(config: EngineConfig, rank: int) -> str:
    """Where rank `rank` of config's instance computes: config.model.device itself at TP 1."""
    if config.parallel.tensor_parallel_size == 1:
        return config.model.device
    return rank_device(config.model.device, rank)


def bring_up_rank(config: EngineConfig, rank: int, comm: Collectives | None) -> RankCompute:
    """Load rank `rank`'s shard of config's model (comm: the collectives its decoder uses, None at TP 1) and
    allocate its KV cache slice of as many blocks as config.cache allows on this rank."""
    device = device_of(config, rank)
    # only rank 0 tokenizes (it schedules and serves HTTP)
    loaded = load_model(
        config.model, config.parallel.tensor_parallel_size, rank, comm, device, with_tokenizer=rank == 0
    )
    dtype = TORCH_DTYPES[config.model.dtype]
    num_kv_heads = loaded.decoder.shard.num_kv_heads  # this rank's
    num_blocks = num_blocks_for(config.cache, loaded.arch, dtype, num_kv_heads)
    kv_cache = allocate_kv_cache(
        loaded.arch, num_blocks, config.cache.block_size, dtype, torch.device(device), num_kv_heads
    )
    return RankCompute(loaded, kv_cache, num_blocks, torch.device(device))
