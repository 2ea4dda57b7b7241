"""The paged KV cache: one contiguous tensor a transfer layer can register once and address by block id."""

from __future__ import annotations

import torch

from pdserve.config import CacheConfig, ConfigError
from pdserve.model.arch import ModelArch
from pdserve.transfer.base import KVCacheSpec


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for(cfg: CacheConfig, arch: ModelArch, dtype: torch.dtype) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    n = int(cfg.kv_cache_memory_gib * 2**30 // bytes_per_block(arch, cfg.block_size, dtype))
    if n < 1:
        raise ConfigError(f"kv_cache_memory_gib {cfg.kv_cache_memory_gib} holds no block of this model")
    return n


def allocate_kv_cache(
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_cache_spec(kv_cache: torch.Tensor, model_name: str, dtype_name: str) -> KVCacheSpec:
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    is_cuda = kv_cache.device.type == "cuda"
    return KVCacheSpec(
        base_addr=kv_cache.data_ptr(),
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        elem_size=kv_cache.element_size(),
        memory="VRAM" if is_cuda else "DRAM",
        device_id=(kv_cache.device.index or 0) if is_cuda else 0,
        model_name=model_name,
        dtype=dtype_name,
    )
