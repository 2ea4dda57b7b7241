"""What every attention path reads: the per-step batch description and the views of the paged KV cache.

The KV cache is block-major with heads before tokens inside a block, [num_blocks, num_layers, 2, num_kv_heads,
block_size, head_dim] (see engine/kv_cache.py for why). One layer is the strided view layer_view() gives, in the
logical order every kernel indexes, [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 holds K, index 1
holds V. Its strides, in elements: block num_layers * 2 * num_kv_heads * block_size * head_dim, token head_dim,
head block_size * head_dim, head_dim 1. Neither (blocks, rows) nor (rows, heads) may be flattened into one
dimension: kernels take the block, token and head strides (a token's K of all heads is not one row). A token at
position p of a sequence lives in block block_table[p // block_size], row p % block_size. The runner builds one
AttentionContext per step and passes it explicitly (no global state).

Both attention.py (portable) and cuda/attention.py (Triton) import this module and not each other's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence computing more than one new token this step (a prompt or a prompt chunk)."""

    query_start: int  # first row of this sequence in the flattened batch
    num_query: int  # new tokens this step
    context_len: int  # tokens with KV after this step (already cached + new)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 block ids


@dataclass
class DecodeBatch:
    """Sequences computing exactly one new token this step, attended in one batched call."""

    rows: torch.Tensor  # [B] int64: row of each sequence's token in the flattened batch
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64: tokens with KV after this step
    max_context_len: int  # max(context_lens), as a Python int
    is_uniform: bool = False  # every context_len equals max_context_len (no padding to mask)
    rows_are_all: bool = False  # rows == arange(T): the step holds decodes only (no gather of q needed)


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block_id * block_size + row) of each new token
    prefills: list[PrefillSpan]
    decode: DecodeBatch | None
    block_size: int


def cache_block_size(kv_cache: torch.Tensor) -> int:
    """Tokens per block of the whole cache ([num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim])."""
    return kv_cache.shape[4]


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of the block-major cache as a strided [2, num_blocks, block_size, num_kv_heads, head_dim] view."""
    return kv_cache[:, layer].transpose(0, 1).transpose(2, 3)  # [2, nb, hkv, bs, d] -> tokens before heads


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V ([T, num_kv_heads, head_dim]) into their slots of one layer's (strided) cache: each token's
    heads land head_stride apart (index_put_ writes through the view's strides)."""
    block_size = layer_cache.shape[2]
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size  # [T] each
    layer_cache[0].index_put_((blocks, rows), k)
    layer_cache[1].index_put_((blocks, rows), v)


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [0, length) of one sequence from one of K or V: [length, num_kv_heads, head_dim] (contiguous)."""
    blocks = cache.index_select(0, block_table)  # [n, block_size, h, d], a contiguous copy of the strided blocks
    return blocks.flatten(0, 1)[:length]
