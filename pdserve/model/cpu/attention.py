"""Paged attention on the CPU that reads the block-major KV cache in place: decode rows (csrc/paged_decode.c)
and prefill spans, whole prompts or after cached context (csrc/paged_prefill.c).

model/attention.py serves decode rows with the decode kernel and prefill spans with the prefill kernel (when
head_dim is a multiple of PANEL and the caller asks for it; else torch's fused SDPA). The prefill kernel
computes the causal triangle only, with register-blocked products (csrc/panel_fma.h), faster than SDPA
(scripts/bench_cpu_prefill.py; figures per machine in docs/benchmarks.md).

Every function takes the loaded library (kernels.library(), which builds it) and float32 CPU tensors (`fits`).
When the library cannot be built or the inputs do not fit, model/attention.py takes the portable
gather-and-matmul path; both give the same tokens (tests/model/test_cpu_attention.py).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.model.paged import DecodeBatch

PANEL = 32  # csrc/panel_fma.h's NB: the prefill kernel reads V rows NB floats at a time


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can read these tensors: float32 on the CPU, head_dim contiguous, K and V alike."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
    )


def prefill_fits(q: torch.Tensor) -> bool:
    """Whether the prefill kernel serves these queries (after `fits`): its panels are PANEL floats of head_dim."""
    return q.shape[-1] % PANEL == 0


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, num_heads, head_dim] float32: one query token per decode sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided layer view)
    v_cache: torch.Tensor,
    d: DecodeBatch,
    scale: float,
    window: int | None,  # keys a query sees, itself included; None = whole context
) -> torch.Tensor:
    """Attention of each decode row over its cached context: [B, num_heads, head_dim] (see the C source)."""
    q = q.contiguous()
    tables, lens = d.block_tables.contiguous(), d.context_lens.contiguous()
    bsz, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    block_stride, row_stride, head_stride, _ = k_cache.stride()
    lib.pdserve_paged_decode_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        row_stride,
        head_stride,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        bsz,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window or 0,
        scale,
        out.data_ptr(),
    )
    return out


def paged_prefill(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_query, num_heads, head_dim] float32: one span's new tokens (a row-strided view too)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided layer view)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(context_len / block_size)] int64
    context_len: int,  # tokens with KV after this step, the span's own included (already written)
    scale: float,
    window: int | None,  # keys a query sees, itself included; None = whole context
) -> torch.Tensor:
    """Causal attention of one prefill span over its cached context, read in place: [num_query, num_heads,
    head_dim] (see the C source). q is read in place when only its token stride is not the contiguous one, as in
    a view of the qkv projection's output."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    table = block_table.contiguous()
    num_query, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    block_stride, row_stride, head_stride, _ = k_cache.stride()
    lib.pdserve_paged_prefill_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        row_stride,
        head_stride,
        table.data_ptr(),
        num_query,
        context_len,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window or 0,
        scale,
        out.data_ptr(),
    )
    return out
