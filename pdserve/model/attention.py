"""Attention over the paged KV cache (portable torch path: CPU and CUDA; CUDA fast path in cuda/attention.py,
CPU kernels in cpu/attention.py).

The batch description (AttentionContext) and the cache views (layer_view, write_kv) live in paged.py, which
both attention paths import.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from pdserve.model.cpu import attention as cpu_attention
from pdserve.model.cpu import kernels as cpu_kernels
from pdserve.model.paged import AttentionContext, DecodeBatch, gather_rows


@cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_kernels_usable(device: torch.device, head_dim: int) -> bool:
    """Whether the Triton/flash CUDA path serves this device and head dim (power of two, >= 16)."""
    return device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and _triton_importable()


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (strided), new K/V written
    ctx: AttentionContext,
    scale: float,
    k: torch.Tensor | None = None,  # [T, num_kv_heads, head_dim]: this step's keys, lets CUDA skip the gather
    v: torch.Tensor | None = None,
    window: int | None = None,  # sliding window: keys a query sees, itself included; None = whole context
    cpu_kernel: bool = True,  # False: CPU decode rows take the portable torch path (tests and benchmarks compare)
    cpu_prefill_kernel: bool = True,  # False: CPU prefill spans take torch's SDPA (scripts/bench_cpu_prefill.py)
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context; returns [T, num_heads, head_dim].

    With a window, the query at position p attends to keys at positions (p - window, p] only (transformers'
    sliding_window_overlay) and reads no block before the one holding key max(0, p - window + 1): a windowed
    layer's older blocks may have been freed and reused (kv/groups.py), their table entries stale.

    On CUDA with k and v given (and Triton present), every layer, windowed or not, dispatches to
    cuda/attention.paged_attention_cuda (the same function: tiled flash prefill, a Triton decode kernel that
    starts at the window). On the CPU (float32, C compiler present) decode rows, windowed or not, take
    cpu/attention.py's in-place decode kernel, and prefill spans (whole prompts, later chunks, prefix hits) its
    in-place prefill kernel when head_dim is a multiple of its panel width (csrc/paged_prefill.c, faster than
    torch's fused SDPA: docs/benchmarks.md); everything else takes the portable torch code below.
    """
    if k is not None and v is not None and cuda_kernels_usable(q.device, q.shape[-1]):
        from pdserve.model.cuda.attention import paged_attention_cuda

        return paged_attention_cuda(q, k, v, layer_cache, ctx, scale, window)
    all_decode = ctx.decode is not None and ctx.decode.rows_are_all
    out = q if all_decode else torch.empty_like(q)  # an all-decode step returns the decode output directly
    num_heads, num_kv_heads = q.shape[1], layer_cache.shape[3]
    group = num_heads // num_kv_heads
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    bs = ctx.block_size
    lib = cpu_kernels.library() if cpu_kernel and cpu_attention.fits(q, k_cache, v_cache) else None
    prefill_lib = lib if lib is not None and cpu_prefill_kernel and cpu_attention.prefill_fits(q) else None
    for span in ctx.prefills:
        rows = slice(span.query_start, span.query_start + span.num_query)
        if prefill_lib is not None:
            o = cpu_attention.paged_prefill(
                prefill_lib, q[rows], k_cache, v_cache, span.block_table, span.context_len, scale, window
            )
            if span.num_query == q.shape[0]:
                return o
            out[rows] = o
            continue
        offset = span.context_len - span.num_query  # tokens cached before this chunk
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, nq, d]: 4-D takes torch's fused CPU kernel (~4x)
        # first key position any query of this span sees; windowed: gather from its block on
        first = 0 if window is None else max(0, offset - window + 1) // bs * bs
        if offset == 0 and k is not None and v is not None:  # whole prompt in this step: no gather needed
            ks, vs = k[rows], v[rows]  # [ctx, hkv, d]
        else:
            table = span.block_table[first // bs :]
            ks = gather_rows(k_cache, table, span.context_len - first)
            vs = gather_rows(v_cache, table, span.context_len - first)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # [1, hkv, ctx - first, d]
        # query head h reads KV head h // group inside SDPA (enable_gqa): no repeat_interleave copy of K and V,
        # measured 1.7x faster at 512 tokens on the CPU (scripts/bench_cpu_layer_ops.py), the same output
        if offset == 0 and (window is None or span.num_query <= window):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # query i sits at position offset + i and sees keys 0 .. offset + i (windowed: the last `window`)
            qpos = torch.arange(span.num_query, device=q.device).unsqueeze(1) + offset
            kpos = torch.arange(first, span.context_len, device=q.device).unsqueeze(0)
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        if span.num_query == q.shape[0]:  # the step is this one span: its output is the whole output, no copy
            return o[0].transpose(0, 1)
        out[rows] = o[0].transpose(0, 1)
    d = ctx.decode
    if d is None:
        return out
    qd = q if d.rows_are_all else q.index_select(0, d.rows)  # [B, num_heads, head_dim]
    if lib is not None:
        od = cpu_attention.paged_decode(lib, qd, k_cache, v_cache, d, scale, window)
    elif window is not None:
        od = _windowed_decode(qd, k_cache, v_cache, d, bs, scale, window)
    else:
        od = _full_decode(qd, k_cache, v_cache, d, scale)
    if d.rows_are_all:
        return od
    out.index_copy_(0, d.rows, od)
    return out


def _full_decode(
    qd: torch.Tensor,  # [B, num_heads, head_dim]: the decode rows' queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    v_cache: torch.Tensor,
    d: DecodeBatch,
    scale: float,
) -> torch.Tensor:
    """Decode rows of a full-context layer, portable: gather every row's blocks, then two matmuls."""
    (bsz, num_heads, hd), num_kv_heads, length = qd.shape, k_cache.shape[2], d.max_context_len
    flat = d.block_tables.flatten()
    kb = k_cache.index_select(0, flat).view(bsz, -1, num_kv_heads, hd)[:, :length]  # [B, L, hkv, d]
    vb = v_cache.index_select(0, flat).view(bsz, -1, num_kv_heads, hd)[:, :length]
    qg = qd.reshape(bsz, num_kv_heads, num_heads // num_kv_heads, hd)
    # matmul over permuted views: measured 2x (batch 8) to 60x (batch 1) faster than einsum on the CPU
    scores = torch.matmul(qg, kb.permute(0, 2, 3, 1)) * scale  # [B, hkv, g, L]
    if not d.is_uniform:
        valid = torch.arange(length, device=qd.device).unsqueeze(0) < d.context_lens.unsqueeze(1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(qd.dtype)
    return torch.matmul(probs, vb.transpose(1, 2)).reshape(bsz, num_heads, hd)  # [B, h, d]


def _windowed_decode(
    qd: torch.Tensor,  # [B, num_heads, head_dim]: the decode rows' queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    v_cache: torch.Tensor,
    d: DecodeBatch,
    bs: int,  # block size
    scale: float,
    window: int,
) -> torch.Tensor:
    """Decode rows of a windowed layer, portable: each reads only the ceil(window / block_size) + 1 table entries
    that can hold its last `window` keys, whatever its context length (O(window) per token, and no stale entry
    read). Returns [B, num_heads, head_dim]."""
    bsz, width = d.block_tables.shape
    num_heads, num_kv_heads, hd = qd.shape[1], k_cache.shape[2], qd.shape[2]
    nwin = -(-window // bs) + 1  # blocks a window can straddle
    lo = (d.context_lens - window).clamp(min=0)  # [B] first key position each row sees
    idx = (lo // bs).unsqueeze(1) + torch.arange(nwin, device=qd.device)  # [B, nwin] table entries
    table = d.block_tables.gather(1, idx.clamp(max=width - 1)).flatten()  # past the table: masked below
    kb = k_cache.index_select(0, table).view(bsz, nwin * bs, num_kv_heads, hd)  # [B, L, hkv, d]
    vb = v_cache.index_select(0, table).view(bsz, nwin * bs, num_kv_heads, hd)
    kpos = (idx.unsqueeze(2) * bs + torch.arange(bs, device=qd.device)).flatten(1)  # [B, L] key positions
    valid = (kpos >= lo.unsqueeze(1)) & (kpos < d.context_lens.unsqueeze(1))
    qg = qd.reshape(bsz, num_kv_heads, num_heads // num_kv_heads, hd)
    scores = torch.matmul(qg, kb.permute(0, 2, 3, 1)) * scale  # [B, hkv, g, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(qd.dtype)
    return torch.matmul(probs, vb.transpose(1, 2)).reshape(bsz, num_heads, hd)  # [B, h, d]
