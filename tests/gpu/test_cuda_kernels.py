"""The CUDA kernels against the portable torch path, bfloat16 on the GPU (fresh random inputs per test)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.attention import paged_attention
from pdserve.model.decoder_layer import RMSNorm
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan, layer_view
from pdserve.model.rotary import apply_rope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16 = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer(make, nb: int, bs: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-major cache [nb, 3 layers, 2, hkv, bs, d], layer 1's strided view): kernels must use the block,
    token and head strides."""
    full = make(nb, 3, 2, hkv, bs, d, device="cuda", dtype=BF16)
    return full, layer_view(full, 1)


def _norm(weight: torch.Tensor) -> RMSNorm:
    n = RMSNorm(weight.shape[0], 1e-6).to(weight.device, weight.dtype)
    n.weight.data.copy_(weight)
    return n


def test_add_rmsnorm_and_silu_match_torch() -> None:
    from pdserve.model.cuda import kernels as ck

    x, r = torch.randn(2, 37, 4096, device="cuda", dtype=BF16).unbind(0)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(BF16)
    out, res = ck.add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(res, x + r)  # the bf16 residual add, rounded like torch
    ref = _norm(w)(x + r)
    assert _rel(out, ref) < 1e-2 and (out != ref).float().mean() < 0.02  # float32 summation order only
    g = torch.randn(5, 2 * 12288, device="cuda", dtype=BF16)
    ref = torch.nn.functional.silu(g[:, :12288]) * g[:, 12288:]
    assert (ck.silu_and_mul(g) != ref).float().mean() < 0.01
    ref = torch.nn.functional.gelu(g[:, :12288], approximate="tanh") * g[:, 12288:]  # gemma's activation
    assert (ck.act_and_mul(g, gelu=True) != ref).float().mean() < 0.01


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_rope_store_matches_torch(qk_norm: bool) -> None:
    from pdserve.model.cuda import kernels as ck

    h, hkv, d, t, bs, nb = 32, 8, 128, 19, 16, 8
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda", dtype=BF16)
    pos = torch.randint(0, 40000, (t,), device="cuda")
    inv = (1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float().cuda()
    qw, kw = ((1 + 0.1 * torch.randn(2, d, device="cuda")).to(BF16)).unbind(0)
    full, cache = _layer(torch.zeros, nb, bs, hkv, d)
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[3] = -1  # not stored
    q0, k0, v0 = qkv.clone().split([h * d, hkv * d, hkv * d], -1)
    q0, k0, v0 = q0.reshape(t, h, d), k0.reshape(t, hkv, d), v0.reshape(t, hkv, d)
    if qk_norm:
        q0, k0 = _norm(qw)(q0), _norm(kw)(k0)
    freqs = pos.float().unsqueeze(-1) * inv
    cos, sin = freqs.cos().to(BF16).unsqueeze(1), freqs.sin().to(BF16).unsqueeze(1)
    qr, kr = apply_rope(q0, cos, sin), apply_rope(k0, cos, sin)
    table = ck.rope_cos_sin(inv, 40000)
    ck.qkv_rope_store(qkv, pos, table, qw if qk_norm else None, kw if qk_norm else None, cache, slots, h, hkv, 1e-6)
    q1, k1 = qkv[:, : h * d].reshape(t, h, d), qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d)
    assert _rel(q1, qr) < 1e-2 and (q1 != qr).float().mean() < (0.02 if qk_norm else 1e-6)
    assert _rel(k1, kr) < 1e-2
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache[0, s // bs, s % bs], k1[i]) and torch.equal(cache[1, s // bs, s % bs], v0[i])
    assert int(cache[0].abs().sum((2, 3)).ne(0).sum()) == t - 1  # nothing else written
    assert full[:, 0].abs().sum() == 0 and full[:, 2].abs().sum() == 0  # nor into other layers


@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 8, 128), (8, 1, 64), (4, 4, 32)])
def test_decode_attention_matches_portable(heads: tuple[int, int, int]) -> None:
    from pdserve.model.cuda.attention import decode_attention

    h, hkv, d = heads
    bs, nb = 16, 1200
    _, cache = _layer(torch.randn, nb, bs, hkv, d)
    lens = [1, 15, 16, 17, 300, 2048, 5000, 0]  # 0: a padding row of a graph
    perm = torch.randperm(nb).tolist()
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    rows = torch.arange(len(lens), device="cuda") * 2 + 1  # decode rows interleaved with others
    q = torch.randn(2 * len(lens) + 1, h, d, device="cuda", dtype=BF16)
    keep = [i for i, n in enumerate(lens) if n > 0]
    ref_batch = DecodeBatch(rows[keep], bt[keep], torch.tensor(lens, device="cuda")[keep], max(lens))
    ref = paged_attention(q.float(), cache.float(), AttentionContext(rows[:0], [], ref_batch, bs), d**-0.5)
    out = torch.full_like(q, float("nan"))
    batch = DecodeBatch(rows, bt, torch.tensor(lens, device="cuda"), max(lens))
    decode_attention(q, cache, batch, d**-0.5, out)
    for i in keep:
        assert _rel(out[rows[i]], ref[rows[i]]) < 1e-2, f"context {lens[i]}"
    assert out[rows[-1]].abs().max() == 0  # empty context: zeros
    assert out[0].isnan().all()  # rows not in the batch untouched


@pytest.mark.parametrize("offset", [0, 5, 300])
def test_prefill_attention_matches_portable(offset: int) -> None:
    """Fresh prompt (offset 0, flash over q/k/v) and a chunk after cached tokens (lower-right causal flash)."""
    from pdserve.model.cuda.attention import prefill_attention

    h, hkv, d, bs, nq = 32, 8, 128, 16, 257
    ctx = offset + nq
    nb = -(-ctx // bs) + 4
    _, cache = _layer(torch.randn, nb, bs, hkv, d)
    table = torch.randperm(nb, device="cuda")[: -(-ctx // bs)]
    slots = (table.repeat_interleave(bs) * bs + torch.arange(bs, device="cuda").repeat(len(table)))[:ctx]
    q = torch.randn(nq, h, d, device="cuda", dtype=BF16)
    k = cache[0][slots[offset:] // bs, slots[offset:] % bs]
    v = cache[1][slots[offset:] // bs, slots[offset:] % bs]
    span = PrefillSpan(0, nq, ctx, table)
    out = prefill_attention(q, k, v, cache, span, d**-0.5)
    ref = paged_attention(q.float(), cache.float(), AttentionContext(slots, [span], None, bs), d**-0.5)
    assert out.shape == (nq, h, d)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 12288), (1000, 96)])
def test_gemv_matches_matmul(shape: tuple[int, int]) -> None:
    from pdserve.model.cuda import kernels as ck

    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    b = torch.randn(n, device="cuda", dtype=BF16)
    ref = x.float() @ w.float().T
    assert _rel(ck.gemv(x, w, None), ref) < 1e-2
    assert _rel(ck.gemv(x, w, b), ref + b.float()) < 1e-2
