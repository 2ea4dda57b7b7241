"""Attention on CUDA: flash prefill through torch SDPA and a Triton paged-decode kernel (split-K).

Same contract as attention.paged_attention (see attention.py for the cache layout and the window's
semantics), plus the fresh K/V of this step, so a prompt with nothing cached attends over them directly
instead of gathering from the cache:

- prefill span, nothing cached before it: SDPA (flash) causal over the fresh q/k/v, GQA native;
- prefill span after cached tokens (chunked prefill, prefix-cache hit): gather the span's K/V from the
  cache, flash with a lower-right causal mask (query i of the chunk sees keys 0 .. offset + i);
- windowed layer (sliding window W), prefill: K/V gathered only from the block holding the first key the
  span's first query sees; queries in tiles of PREFILL_TILE rows, each over keys [tile_start - W + 1,
  tile_end): flash causal where the tile's window reaches its first key, else an explicit [tile, tile + W)
  band mask. Flash takes no band mask, and one mask over the whole prompt would be O(n^2);
- decode rows: one Triton program per (sequence, kv head, split) reads the sequence's pages straight from
  the block table, keeps the group's query heads in one tile, and writes a partial softmax; a second kernel
  merges the splits. With a window the splits share the last W keys only: pages before the one holding
  key max(0, L - W) are never loaded (a windowed group's table entries there may be STALE, kv/groups.py).
  Split count is a function of the batch size and the layer's window, never of the context lengths, so a
  captured CUDA graph stays valid.

The cache is addressed only through the layer view's strides (block, row, head; the head dim contiguous).
Imported only on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan, gather_rows

DECODE_BLOCK_N = 64  # tokens per inner tile of the decode kernel
TARGET_PROGRAMS = 512  # decode programs to aim for (about 4 per multiprocessor on an H200)
MAX_SPLITS = 32
PREFILL_TILE = 1024  # query rows per windowed prefill tile: its band mask is [tile, tile + window - 1]


NO_WINDOW = 1 << 30  # the kernel's window argument for a full-context layer (more keys than any context)


def num_splits(batch_size: int, num_kv_heads: int, window: int | None = None) -> int:
    """Splits of each sequence's context in the decode kernel: enough programs to fill the GPU, and for a
    windowed layer no more than the window has BLOCK_N tiles. A function of the batch size and the layer
    alone (never of the context lengths), so a captured CUDA graph stays valid."""
    splits = max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, batch_size * num_kv_heads)))
    return splits if window is None else max(1, min(splits, -(-window // DECODE_BLOCK_N)))


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    BT,
    LENS,
    ROWS,
    ACC,
    LSE,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    scale,
    window,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(LENS + b)
    lo = tl.maximum(ctx - window, 0)  # first key this row sees: the splits share [lo, ctx) only
    per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + s * per_split  # pages before lo's are never loaded (a windowed table's entries there are STALE)
    end = tl.minimum(start + per_split, ctx)
    row = tl.load(ROWS + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    gmask = g < GROUP
    q = tl.load(
        Q + row * stride_qt + (hkv * GROUP + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0
    )  # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(BT + b.to(tl.int64) * stride_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = page * stride_kb + (t % PAGE) * stride_kt + hkv * stride_kh  # [BLOCK_N]
        k = tl.load(K + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)  # [BLOCK_N, D]
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(tmask[None, :], qk * scale, float("-inf"))  # [G_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    head = hkv * GROUP + g  # [G_PAD]
    out_idx = (b * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + s  # [G_PAD]
    tl.store(LSE + out_idx, lse, mask=gmask)
    tl.store(ACC + out_idx[:, None] * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(
    ACC, LSE, ROWS, OUT, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = b * tl.num_programs(1) + h
    s = tl.arange(0, S_PAD)
    smask = s < NUM_SPLITS
    lse = tl.load(LSE + base * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    total = tl.sum(w, axis=0)
    d = tl.arange(0, D)
    acc = tl.load(ACC + (base * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    row = tl.load(ROWS + b)
    tl.store(OUT + row * stride_ot + h * stride_oh + d, o.to(OUT.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], may be a strided view (rows of a fused qkv)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
    decode: DecodeBatch,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]: rows decode.rows are written
    window: int | None = None,  # keys a query sees, itself included; None = the whole context
) -> None:
    """Paged attention of one query token per sequence over its cached context (context_lens tokens); with a
    window, over the last `window` of them, reading no page before the one that holds the first."""
    bsz = decode.rows.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    splits = num_splits(bsz, num_kv_heads, window)
    acc = torch.empty((bsz, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, num_heads, splits), dtype=torch.float32, device=q.device)
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and out.stride(-1) == 1
    assert v_cache.stride() == k_cache.stride()  # the kernel reads K and V at the same offsets (block stride)
    _decode_partial_kernel[(bsz, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        decode.block_tables,
        decode.context_lens,
        decode.rows,
        acc,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        decode.block_tables.stride(0),
        scale,
        NO_WINDOW if window is None else window,
        NUM_SPLITS=splits,
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        D=head_dim,
        PAGE=page,
        BLOCK_N=DECODE_BLOCK_N,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(bsz, num_heads)](
        acc,
        lse,
        decode.rows,
        out,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        S_PAD=max(2, triton.next_power_of_2(splits)),
        D=head_dim,
        num_warps=4,
    )


def _flash_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention aligned to the bottom right (q [1, h, nq, d] are the last nq of k's nk positions)."""
    if q.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
        except RuntimeError:
            pass  # flash unavailable for this shape: the portable masked call below
    nq, nk = q.shape[2], k.shape[2]
    qpos = torch.arange(nq, device=q.device).unsqueeze(1) + (nk - nq)
    mask = torch.arange(nk, device=q.device).unsqueeze(0) <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Sliding-window attention of a query tile (q [1, h, nq, d]) over the keys that end with it (k, v
    [1, hkv, nk, d]; the last query and the last key share a position): flash with a lower-right causal mask where
    every query sees all of them, else an explicit band mask ([nq, nk], memory-efficient SDPA)."""
    nq, nk = q.shape[2], k.shape[2]
    if nk <= window:  # the last query's window reaches the first key: no band inside this tile
        return _flash_lower_right(q, k, v, scale)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # the masked kernels take no GQA: repeat K/V over the group (one tile's worth)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qpos = torch.arange(nq, device=q.device).unsqueeze(1) + (nk - nq)
    kpos = torch.arange(nk, device=q.device).unsqueeze(0)
    mask = (kpos <= qpos) & (kpos > qpos - window)  # [nq, nk]: query i sees (i - window, i], shifted
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], this step's keys (already rotated)
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    window: int | None = None,  # keys a query sees, itself included; None = the whole context
    tile: int = PREFILL_TILE,  # query rows per windowed tile
) -> torch.Tensor:
    """Attention of one prefill span; returns [num_query, num_heads, head_dim].

    With a window the span's K/V are gathered from the first block its first query sees (STALE entries before
    it are never read) and the queries go in tiles of `tile` rows, each over the keys its window
    reaches: O(num_query * window) work and memory, whatever the context length."""
    rows = slice(span.query_start, span.query_start + span.num_query)
    qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, nq, d]
    offset = span.context_len - span.num_query
    bs = layer_cache.shape[2]
    first = 0 if window is None else max(0, offset - window + 1) // bs * bs  # first key position gathered
    if offset == 0:
        ks, vs = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        if window is None or span.num_query <= window:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
    else:
        table = span.block_table[first // bs :]
        ks = gather_rows(layer_cache[0], table, span.context_len - first).transpose(0, 1).unsqueeze(0)
        vs = gather_rows(layer_cache[1], table, span.context_len - first).transpose(0, 1).unsqueeze(0)
        if window is None:
            return _flash_lower_right(qs, ks, vs, scale)[0].transpose(0, 1)
    assert window is not None
    out = torch.empty(q[rows].shape, dtype=q.dtype, device=q.device)  # [nq, h, d]
    for a in range(offset, span.context_len, tile):  # query positions [a, b) of this tile
        b = min(a + tile, span.context_len)
        k0 = max(first, a - window + 1) - first  # first key the tile's first query sees, as an index into ks
        o = _band_attention(qs[:, :, a - offset : b - offset], ks[:, :, k0 : b - first], vs[:, :, k0 : b - first],
                            window, scale)  # fmt: skip
        out[a - offset : b - offset] = o[0].transpose(0, 1)
    return out


def paged_attention_cuda(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], fresh (rotated) keys of this step, also in the cache
    v: torch.Tensor,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (strided), new K/V written
    ctx: AttentionContext,
    scale: float,
    window: int | None = None,  # keys a query sees, itself included; None = the whole context
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's context (with a window: over the last `window`
    keys, as attention.paged_attention); returns [T, num_heads, head_dim]."""
    t = q.shape[0]
    if ctx.decode is None and len(ctx.prefills) == 1 and ctx.prefills[0].num_query == t:
        return prefill_attention(q, k, v, layer_cache, ctx.prefills[0], scale, window)  # the step is one prompt
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for span in ctx.prefills:
        rows = slice(span.query_start, span.query_start + span.num_query)
        out[rows] = prefill_attention(q, k, v, layer_cache, span, scale, window)
    if ctx.decode is not None:
        decode_attention(q, layer_cache, ctx.decode, scale, out, window)
    return out
