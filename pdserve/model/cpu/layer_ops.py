"""A decoder layer's small ops on the CPU as single C/OpenMP passes (csrc/layer_ops.c, built with the paged
attention kernels into one library by kernels.py): add + RMSNorm, q/k-norm + rotary + KV store, and
SiLU- (or GELU-tanh-) and-mul. The same three calls as cuda/kernels.py's Triton kernels, for the same reason:
the portable RMSNorm alone is ~6 torch ops, each its own pass over the rows and its own OpenMP region, 30 layers
a step. layer.forward_cpu calls them; equality with the portable torch ops is tested in
tests/model/test_cpu_layer_ops.py.

Every function takes the loaded library (kernels.library()) and float32 CPU tensors (`fits`).
"""

from __future__ import annotations

import ctypes

import torch


def fits(x: torch.Tensor, layer_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernels take this step: float32 hidden states and cache on the CPU, head_dim contiguous in the
    cache (any block/row/head strides), an even head_dim (rotary halves)."""
    return (
        x.device.type == "cpu"
        and x.dtype == layer_cache.dtype == torch.float32
        and layer_cache.stride(-1) == 1
        and layer_cache[0].stride() == layer_cache[1].stride()
        and head_dim % 2 == 0
    )


def add_rmsnorm(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) for x [T, n]; with residual None: (norm(x) * weight, x).
    The residual is updated in place (it becomes x + residual) and returned: the caller owns the stream."""
    x = x.contiguous()
    t, n = x.shape
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    lib.pdserve_add_rmsnorm_f32(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps, t, n, out.data_ptr()
    )
    return out, x if residual is None else residual


def qkv_rope_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim] contiguous, modified in place
    cos: torch.Tensor,  # [T, 1, head_dim / 2] float32 (Decoder._cos_sin)
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,  # [head_dim] (qwen3, gemma 3) or None
    k_norm_weight: torch.Tensor | None,
    eps: float,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
    slot_mapping: torch.Tensor,  # [T] int64 block_id * block_size + row; negative = do not store
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Per-head RMSNorm of q and k (when weights are given), rotary on q and k in place, and this step's K and V
    stored into their cache slots (paged.write_kv's job, through the cache's strides)."""
    assert qkv.is_contiguous()
    t = qkv.shape[0]
    head_dim = layer_cache.shape[-1]
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slot_mapping.contiguous()
    k_cache, v_cache = layer_cache[0], layer_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_stride, row_stride, head_stride, _ = k_cache.stride()
    lib.pdserve_qkv_rope_store_f32(
        qkv.data_ptr(),
        t,
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        None if q_norm_weight is None else q_norm_weight.data_ptr(),
        None if k_norm_weight is None else k_norm_weight.data_ptr(),
        eps,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        row_stride,
        head_stride,
        k_cache.shape[1],
        slots.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
    )


def act_and_mul(lib: ctypes.CDLL, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """x [T, 2 * n] = (gate | up) -> act(gate) * up [T, n]; act is SiLU, or GELU-tanh (gemma) with gelu."""
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype)
    lib.pdserve_act_and_mul_f32(x.data_ptr(), t, n, int(gelu), out.data_ptr())
    return out
