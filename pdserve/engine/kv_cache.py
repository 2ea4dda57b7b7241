"""The paged KV cache: one contiguous, block-major tensor a transfer layer can register once and address by block.

Shape [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (heads before tokens inside a block, as
vLLM's HND layout): one block's K and V of every layer are one contiguous byte range, so moving a run of blocks
between instances is one NIXL descriptor however many layers the model has (a layer-major cache needs
2 x layers descriptors per scattered block). Its sizes and byte offsets are one CacheGeometry's
(kv/geometry.py). Kernels see one layer through paged.layer_view(): a strided [2, num_blocks, block_size,
num_kv_heads, head_dim] view (the logical order every kernel indexes) whose block stride is num_layers * 2 *
num_kv_heads * block_size * head_dim elements, head stride block_size * head_dim and token stride head_dim.

Sliding-window and hybrid models (kv/groups.py): a block holds the layers of one KV group,
[num_blocks, layers_per_block, 2, num_kv_heads, block_size, head_dim]; with one group (every model whose layers
share one attention type) layers_per_block = num_layers and all of the above holds as is.

Heads before tokens inside a block, decided on transfer cost (transfer/layout.py):
- whole-block transfers between equal TP sizes, the common case, are one range per run of blocks either way;
- a heterogeneous-TP transfer moves one rank's head slice, and heads outer make that slice of a (block, layer,
  K/V) one contiguous range ([h0, h1) x block_size x head_dim); tokens outer made it one range per token row
  (64 layers x 2 x 2048 tokens = 262144 descriptors for a 2k prompt, per producer rank);
- the price is a partial block (P and D block sizes differ, a window's start) with heads outer is one range
  per (layer, K/V, head) instead of one per (layer, K/V); the common partial block, the prompt's last, is sent
  whole instead (the rows past the prompt are D's own, written by D after the transfer lands: layout.py);
- kernels address the cache through strides (a token's heads are head_stride apart, head_dim contiguous), so
  the layout costs them nothing but strided stores.
"""

from __future__ import annotations

import torch

from pdserve.config import CacheConfig, ConfigError
from pdserve.kv.geometry import CacheGeometry
from pdserve.kv.groups import KVGroups
from pdserve.model.arch import ModelArch
from pdserve.transfer.base import KVCacheSpec


def cache_geometry(
    arch: ModelArch, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None, num_blocks: int = 0
) -> CacheGeometry:
    """The geometry of `arch`'s cache (of `num_kv_heads` heads: a tensor-parallel rank's; default all)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    return CacheGeometry.of(arch.layer_windows, arch.num_layers, heads, arch.head_dim, elem, block_size, num_blocks,
                            arch.num_kv_heads)  # fmt: skip


def num_blocks_for(cfg: CacheConfig, arch: ModelArch, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Blocks of the cache: cfg.num_blocks, or as many as kv_cache_memory_gib holds (per rank, of its heads)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    n = int(cfg.kv_cache_memory_gib * 2**30 // cache_geometry(arch, cfg.block_size, dtype, num_kv_heads).block_bytes)
    if n < 1:
        raise ConfigError(f"kv_cache_memory_gib {cfg.kv_cache_memory_gib} holds no block of this model")
    return n


def allocate_kv_cache(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,  # a tensor-parallel rank's KV heads; default all of the model's
) -> torch.Tensor:
    """[num_blocks, layers_per_block, 2, num_kv_heads, block_size, head_dim] (heads before tokens), zeroed."""
    return torch.zeros(
        cache_geometry(arch, block_size, dtype, num_kv_heads, num_blocks).shape, dtype=dtype, device=device
    )


def kv_cache_spec(
    kv_cache: torch.Tensor,
    model_name: str,
    dtype_name: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int = 0,  # the model's (0: this cache holds them all)
    rank_ports: tuple[int, ...] = (),  # rank 0: every rank's side-channel port
    kv_groups: KVGroups | None = None,  # the model's KV layer groups (None: one full-attention group)
) -> KVCacheSpec:
    """The spec of an allocated cache: its geometry read off the tensor's shape, where it is, whose it is."""
    num_blocks, layers_per_block, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    groups = kv_groups or KVGroups.of((), layers_per_block)
    if groups.layers_per_block != layers_per_block:
        raise ValueError(
            f"the cache holds {layers_per_block} layers per block, its KV groups {groups.layers_per_block}"
        )
    geometry = CacheGeometry(num_blocks, block_size, num_kv_heads, total_kv_heads or num_kv_heads, head_dim,
                             kv_cache.element_size(), groups)  # fmt: skip
    is_cuda = kv_cache.device.type == "cuda"
    return KVCacheSpec(
        geometry=geometry,
        base_addr=kv_cache.data_ptr(),
        memory="VRAM" if is_cuda else "DRAM",
        device_id=(kv_cache.device.index or 0) if is_cuda else 0,
        model_name=model_name,
        dtype=dtype_name,
        tp_rank=tp_rank,
        tp_size=tp_size,
        rank_ports=rank_ports,
    )
