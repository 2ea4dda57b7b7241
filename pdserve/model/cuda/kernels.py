"""Fused elementwise Triton kernels of the CUDA decoder: add+RMSNorm, q/k-norm+rotary+KV store, SiLU- (or
GELU-tanh-) and-mul.

Each kernel replaces 5-15 small torch ops (one launch and one pass over memory instead of many), which is
what batch-1 decode is made of once the matmuls are memory-bound. Arithmetic is float32 inside; every
intermediate that torch (and transformers) would round to the model dtype is rounded here too, so the
fused path computes the same function as the portable one up to float32 summation order.

Imported only on CUDA (Triton is not needed on the CPU). Head dims must be powers of two (see supports()).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2, head_dim / 2] float32 table of cos and sin of position * inv_freq, computed by torch
    exactly as the portable path (and transformers) computes them, so the fused rotary matches theirs."""
    pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = pos.unsqueeze(-1) * inv_freq  # [P, head_dim / 2]
    return torch.stack([freqs.cos(), freqs.sin()], dim=1).contiguous()


def supports(head_dim: int) -> bool:
    """Whether the fused kernels handle this head dim (rotary halves must be a power of two, >= 8)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@triton.jit
def _rnd(x, dtype: tl.constexpr):
    """Round a float32 value to `dtype` and back (what a torch op in that dtype does to its output).

    bfloat16 rounds by integer arithmetic (to nearest, ties to even): the compiler folds a plain
    float32 -> bfloat16 -> float32 round trip away, which silently skips the rounding."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _add_rmsnorm_kernel(
    X,
    R,
    W,
    OUT,
    R_OUT,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dt = OUT.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rnd(x + r, dt)  # the residual add, in the model dtype
        tl.store(R_OUT + row * stride_ro + cols, x.to(dt), mask=mask)
    var = tl.sum(x * x, axis=0) / n
    y = _rnd(x * tl.rsqrt(var + eps), dt)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * y).to(dt), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) for x [T, n]; with residual None: (norm(x) * weight, x)."""
    t, n = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    if residual is None:
        _add_rmsnorm_kernel[(t,)](
            x, x, weight, out, x, x.stride(0), 0, out.stride(0), 0, n, eps, HAS_RES=False, BLOCK=block, num_warps=warps
        )
        return out, x
    res_out = torch.empty_like(x)
    _add_rmsnorm_kernel[(t,)](
        x,
        residual,
        weight,
        out,
        res_out,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RES=True,
        BLOCK=block,
        num_warps=warps,
    )
    return out, res_out


@triton.jit
def _qkv_rope_store_kernel(
    QKV,
    POS,
    COS_SIN,
    QW,
    KW,
    K_CACHE,
    V_CACHE,
    SLOTS,
    stride_t,
    stride_kb,
    stride_kt,
    stride_kh,
    eps,
    max_pos,
    PAGE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0..NUM_HEADS-1: q heads, then k heads, then v heads
    dt = QKV.dtype.element_ty
    d = tl.arange(0, HALF)
    base = QKV + t * stride_t + h * (2 * HALF)
    slot = tl.load(SLOTS + t)  # -1: a padding row of a captured graph, store nothing
    cache_off = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kt  # block-major: blocks are strided apart
    if h < NUM_HEADS + NUM_KV_HEADS:
        x1 = tl.load(base + d).to(tl.float32)
        x2 = tl.load(base + HALF + d).to(tl.float32)
        if QK_NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            if h < NUM_HEADS:
                w1 = tl.load(QW + d).to(tl.float32)
                w2 = tl.load(QW + HALF + d).to(tl.float32)
            else:
                w1 = tl.load(KW + d).to(tl.float32)
                w2 = tl.load(KW + HALF + d).to(tl.float32)
            x1 = _rnd(w1 * _rnd(x1 * r, dt), dt)
            x2 = _rnd(w2 * _rnd(x2 * r, dt), dt)
        p = tl.minimum(tl.load(POS + t), max_pos - 1)  # beyond the table: clamped, never out of bounds
        c = _rnd(tl.load(COS_SIN + p * (2 * HALF) + d), dt)
        s = _rnd(tl.load(COS_SIN + p * (2 * HALF) + HALF + d), dt)
        o1 = (_rnd(x1 * c, dt) - _rnd(x2 * s, dt)).to(dt)
        o2 = (_rnd(x2 * c, dt) + _rnd(x1 * s, dt)).to(dt)
        tl.store(base + d, o1)
        tl.store(base + HALF + d, o2)
        if h >= NUM_HEADS:
            if slot >= 0:
                dst = K_CACHE + cache_off + (h - NUM_HEADS) * stride_kh
                tl.store(dst + d, o1)
                tl.store(dst + HALF + d, o2)
    else:
        if slot >= 0:
            dst = V_CACHE + cache_off + (h - NUM_HEADS - NUM_KV_HEADS) * stride_kh
            tl.store(dst + d, tl.load(base + d))
            tl.store(dst + HALF + d, tl.load(base + HALF + d))


def qkv_rope_store(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], modified in place (q, k rotated)
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_positions, 2, head_dim / 2] float32: cos and sin of position * inv_freq
    q_norm_weight: torch.Tensor | None,  # [head_dim] (qwen3) or None
    k_norm_weight: torch.Tensor | None,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
    slot_mapping: torch.Tensor,  # [T] int64 block_id * block_size + row; -1 = do not store
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """Per-head RMSNorm of q and k (when given), rotary on q and k in place, and K/V stored into their slots."""
    t = qkv.shape[0]
    head_dim = layer_cache.shape[-1]
    qk_norm = q_norm_weight is not None
    k_cache = layer_cache[0]  # [num_blocks, block_size, num_kv_heads, head_dim]; heads stride(2) apart (HND)
    assert k_cache.stride(3) == 1 and layer_cache[1].stride() == k_cache.stride()
    _qkv_rope_store_kernel[(t, num_heads + 2 * num_kv_heads)](
        qkv,
        positions,
        cos_sin,
        q_norm_weight if qk_norm else cos_sin,
        k_norm_weight if qk_norm else cos_sin,
        k_cache,
        layer_cache[1],
        slot_mapping,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        cos_sin.shape[0],
        PAGE=k_cache.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        QK_NORM=qk_norm,
        num_warps=1,
    )


@triton.jit
def _act_mul_kernel(X, OUT, stride_x, stride_o, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dt = OUT.dtype.element_ty
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation, computed as torch's CUDA kernel does (libdevice tanh = CUDA's tanhf)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (g + 0.044715 g^3)
        s = _rnd(0.5 * g * (1.0 + libdevice.tanh(y)), dt)
    else:
        s = _rnd(g / (1.0 + tl.exp(-g)), dt)
    tl.store(OUT + row * stride_o + cols, (s * u).to(dt), mask=mask)


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
        for bn, bk, w in [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 256, 4), (32, 256, 8)]
    ],
    key=["N", "K"],
)
@triton.jit
def _gemv_kernel(X, W, B, OUT, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    rows = W + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(X + k, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(OUT + n, y.to(OUT.dtype.element_ty), mask=nmask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N]: batch-1 linear layer as one bandwidth-bound pass over the
    weight (cuBLAS reaches 1.8-2.6 TB/s on the 8B shape's smaller matrices; see engine_detail.json)."""
    n, k = weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](
        x, weight, weight if bias is None else bias, out, n, k, weight.stride(0), HAS_BIAS=bias is not None
    )
    return out


def act_and_mul(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """x [T, 2 * n] = (gate | up) -> act(gate) * up [T, n]; act is SiLU, or GELU-tanh (gemma) with gelu."""
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(4096, triton.next_power_of_2(n))
    _act_mul_kernel[(t, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, GELU=gelu, BLOCK=block, num_warps=4 if block <= 1024 else 8
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * n] = (gate | up) -> silu(gate) * up [T, n]."""
    return act_and_mul(x)
