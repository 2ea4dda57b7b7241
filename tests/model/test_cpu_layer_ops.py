"""The CPU layer kernels (model/cpu/layer_ops.py, csrc/layer_ops.c) against the portable torch ops they replace
(decoder_layer.RMSNorm, rotary.apply_rope, paged.write_kv, F.silu / F.gelu-tanh times up), float32, on odd shapes;
and the decoder's fused CPU path against its portable path, hidden states and greedy tokens."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_generate import _llm, _prompts

from pdserve import SamplingParams
from pdserve.model.cpu import layer_ops as ops
from pdserve.model.decoder_layer import RMSNorm
from pdserve.model.paged import layer_view, write_kv
from pdserve.model.rotary import apply_rope

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


@pytest.mark.parametrize("rows, n", [(1, 5), (7, 37), (33, 576), (130, 257)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(lib: ctypes.CDLL, rows: int, n: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=gen)
    x = torch.randn(rows, n, generator=gen) * 3
    residual = torch.randn(rows, n, generator=gen) if with_residual else None
    expected_stream = x + residual if residual is not None else x
    with torch.no_grad():
        expected = norm(expected_stream)
        h, stream = ops.add_rmsnorm(lib, x, None if residual is None else residual.clone(), norm.weight, norm.eps)
    torch.testing.assert_close(stream, expected_stream, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(h, expected)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 2, 1, 6), (13, 6, 2, 18), (37, 9, 3, 64)])
def test_qkv_rope_store(lib: ctypes.CDLL, qk_norm: bool, tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens + heads)
    num_blocks, num_layers, bs = 20, 3, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randperm(200, generator=gen)[:tokens]
    freqs = positions.float().unsqueeze(-1) / (100.0 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)  # [T, 1, head_dim / 2]
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]  # shuffled slots over blocks
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

    # portable: split, per-head norm, rotate, write_kv into a strided block-major layer view
    kv_ref = torch.randn(num_blocks, num_layers, 2, kv_heads, bs, head_dim, generator=gen)
    kv_ours = kv_ref.clone()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    with torch.no_grad():
        if qk_norm:
            q, k = q_norm(q), k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(layer_view(kv_ref, 1), k, v.reshape(tokens, kv_heads, head_dim), slots)

    ours = qkv.clone()
    weights = (q_norm.weight, k_norm.weight) if qk_norm else (None, None)
    ops.qkv_rope_store(lib, ours, cos, sin, *weights, 1e-6, layer_view(kv_ours, 1), slots, heads, kv_heads)
    torch.testing.assert_close(ours[:, : heads * head_dim].view_as(q), q)
    torch.testing.assert_close(ours[:, heads * head_dim :], torch.cat([k.flatten(1), v], dim=-1))
    torch.testing.assert_close(kv_ours, kv_ref)  # other layers and untouched slots unchanged too


def test_qkv_rope_store_skips_negative_slots(lib: ctypes.CDLL) -> None:
    kv = torch.zeros(4, 1, 2, 1, 2, 4)
    qkv = torch.ones(2, 3 * 4)
    cos, sin = torch.ones(2, 1, 2), torch.zeros(2, 1, 2)
    ops.qkv_rope_store(lib, qkv, cos, sin, None, None, 1e-6, layer_view(kv, 0), torch.tensor([-1, 5]), 1, 1)
    stored = layer_view(kv, 0).flatten(1, 2)  # [2, slots, 1, 4]
    assert stored[:, 5].eq(1).all() and stored.sum() == 2 * 4  # only slot 5, K and V


@pytest.mark.parametrize("rows, n", [(1, 3), (5, 41), (64, 1536)])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul(lib: ctypes.CDLL, rows: int, n: int, gelu: bool) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 2 * n, generator=gen) * 4
    x[0, 0], x[-1, n - 1] = -200.0, 150.0  # saturated gates: exp underflows / overflows
    gate, up = x.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    torch.testing.assert_close(ops.act_and_mul(lib, x, gelu), act * up)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen2_swa"])
def test_fused_equals_portable(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Through the engine: the same greedy tokens with the fused CPU layers as with the portable ones."""
    prompts = _prompts([3, 17, 30], seed=7)
    outs = []
    for kernel in (True, False):
        llm = _llm(tiny_model_dirs[family], block_size=4, max_num_batched_tokens=16)
        llm.engine.runner.decoder.use_cpu_kernel = kernel
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(24))])
    assert outs[0] == outs[1]
