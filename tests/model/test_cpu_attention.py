"""The CPU attention kernels (model/cpu/attention.py, built by model/cpu/kernels.py) against the portable path:
the same attention output on block-major caches with shuffled, padded and stale table entries (GQA, ragged
lengths, sliding windows, decode rows mixed with a prefill), the same greedy tokens through the engine, and a
clean fallback without a compiler."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generate import _llm, _prompts

from pdserve import SamplingParams
from pdserve.model.attention import paged_attention
from pdserve.model.cpu import attention as cpu_attention
from pdserve.model.cpu import kernels as cpu_kernels
from pdserve.model.cpu import layer_ops as cpu_layer_ops
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan, layer_view

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


@needs_compiler
def test_kernel_builds() -> None:
    assert cpu_kernels.library() is not None


def test_no_compiler_falls_back(tmp_path: Path) -> None:
    """No compiler: nothing is built and the caller takes the portable path."""
    assert cpu_kernels.build(tmp_path, compiler=str(tmp_path / "no-such-cc")) is None
    assert not list(tmp_path.rglob("*.so"))


@needs_compiler
@pytest.mark.parametrize("window", [None, 1, 5, 17])
@pytest.mark.parametrize("with_prefill", [False, True])
# head dims of 2, 3 (the scalar loops), 8 and 16 vectors of 8 floats; blocks shorter and longer than the dots' RB
@pytest.mark.parametrize(("bs", "d"), [(4, 16), (16, 24), (16, 64), (8, 128)])
def test_kernel_equals_portable(window: int | None, with_prefill: bool, bs: int, d: int) -> None:
    gen = torch.Generator().manual_seed(window or 0)
    num_blocks, num_layers, h, hkv = 40, 3, 6, 2
    kv = torch.randn(num_blocks, num_layers, 2, hkv, bs, d, generator=gen)  # block-major, as the engine's
    layer = layer_view(kv, 1)  # strided: blocks are num_layers * 2 * hkv * bs * d apart, heads bs * d
    lens = [1, 9, 23, 16, 37]
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        used = [perm.pop() for _ in range(-(-n // bs))]
        if window is not None:  # entries before the window's first block are stale (out of range: never read)
            used[: max(0, n - window) // bs] = [10**6] * (max(0, n - window) // bs)
        tables.append(used + [0] * (width - len(used)))
    prefill_rows = 5 if with_prefill else 0
    rows = torch.arange(len(lens)) + prefill_rows
    decode = DecodeBatch(rows, torch.tensor(tables), torch.tensor(lens), max(lens), rows_are_all=not with_prefill)
    prefills = [PrefillSpan(0, prefill_rows, prefill_rows, torch.tensor(perm[:2]))] if with_prefill else []
    q = torch.randn(prefill_rows + len(lens), h, d, generator=gen)
    ctx = AttentionContext(torch.zeros(q.shape[0], dtype=torch.long), prefills, decode, bs)
    ours = paged_attention(q, layer, ctx, 0.3, None, None, window, cpu_kernel=True)
    portable = paged_attention(q, layer, ctx, 0.3, None, None, window, cpu_kernel=False)
    torch.testing.assert_close(ours, portable)


@needs_compiler
@pytest.mark.parametrize("family", ["llama", "mistral_swa"])
def test_same_tokens(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Greedy tokens through the engine are the same with the kernel and with the portable path."""
    prompts = _prompts([3, 17, 30], seed=5)
    outs = []
    for kernel in (True, False):
        llm = _llm(tiny_model_dirs[family], block_size=4, max_num_batched_tokens=16)
        llm.engine.runner.decoder.use_cpu_kernel = kernel
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(24))])
    assert outs[0] == outs[1]


@needs_compiler
def test_engine_runs_the_c_kernels(tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 CPU engine, built as the server builds it, runs its decode attention and its layers' small ops
    in the C library (model/cpu/kernels.py builds it), and calls no kernel once the decoder is told not to."""
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return counted

    monkeypatch.setattr(cpu_attention, "paged_decode", counting("paged_decode", cpu_attention.paged_decode))
    monkeypatch.setattr(cpu_layer_ops, "add_rmsnorm", counting("add_rmsnorm", cpu_layer_ops.add_rmsnorm))
    llm = _llm(tiny_model_dirs["llama"], block_size=4, max_num_batched_tokens=16)
    llm.generate(_prompts([3, 17], seed=2), SamplingParams.greedy(4))
    assert calls["paged_decode"] > 0 and calls["add_rmsnorm"] > 0
    calls.clear()
    llm.engine.runner.decoder.use_cpu_kernel = False
    llm.generate(_prompts([3, 17], seed=2), SamplingParams.greedy(4))
    assert calls == Counter()


def _hnd(kv: torch.Tensor) -> torch.Tensor:
    """The same block-major cache, heads before tokens inside each block (strides, not values, differ)."""
    n, layers, two, bs, hkv, d = kv.shape
    return kv.permute(0, 1, 2, 4, 3, 5).contiguous().permute(0, 1, 2, 4, 3, 5)


@needs_compiler
@pytest.mark.parametrize("window", [None, 1, 6, 13])
@pytest.mark.parametrize("heads_first", [False, True])
def test_prefill_over_cache_equals_portable(window: int | None, heads_first: bool) -> None:
    """The prefill kernel over cached context (later chunks, ragged, GQA, shuffled blocks) reads the cache in
    place and equals the portable gather-and-SDPA path, windows and both in-block
    layouts included; entries before a window's first needed block are stale (out of range: never read)."""
    gen = torch.Generator().manual_seed(7 + (window or 0))
    num_blocks, num_layers, bs, h, hkv, d = 60, 2, 4, 6, 2, 32
    kv = torch.randn(num_blocks, num_layers, 2, bs, hkv, d, generator=gen)
    layer = (_hnd(kv) if heads_first else kv)[:, 1].transpose(0, 1)  # [2, nb, bs, hkv, d] in either stride order
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spans, row = [], 0
    for num_query, context_len in [(5, 9), (21, 38), (1, 3), (16, 16 + 17)]:  # (new tokens, context after step)
        used = [perm.pop() for _ in range(-(-context_len // bs))]
        if window is not None:  # the span's first query sees keys from offset - window + 1 on
            stale = max(0, context_len - num_query - window + 1) // bs
            used[:stale] = [10**6] * stale
        spans.append(PrefillSpan(row, num_query, context_len, torch.tensor(used)))
        row += num_query
    q = torch.randn(row, h, d, generator=gen)
    ctx = AttentionContext(torch.zeros(row, dtype=torch.long), spans, None, bs)
    portable = paged_attention(q, layer, ctx, 0.3, None, None, window, cpu_kernel=False)
    lib = cpu_kernels.library()
    assert lib is not None
    k_cache, v_cache = layer[0], layer[1]
    for span in spans:
        rows = slice(span.query_start, span.query_start + span.num_query)
        table, n = span.block_table, span.context_len
        ours = cpu_attention.paged_prefill(lib, q[rows], k_cache, v_cache, table, n, 0.3, window)
        torch.testing.assert_close(ours, portable[rows])


@needs_compiler
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize(("h", "hkv", "d"), [(6, 2, 32), (4, 4, 64), (8, 1, 32)])
def test_whole_prompt_kernel_equals_sdpa(window: int | None, h: int, hkv: int, d: int) -> None:
    """What attention.py dispatches for a whole prompt on the CPU (the prefill kernel, causal triangle only)
    equals torch's SDPA path for prompts shorter than, equal to and past its 32-query tiles and 32-key steps,
    GQA and MQA, windows narrower and wider than a tile, two prompts in one step, blocks shuffled."""
    gen = torch.Generator().manual_seed(h * 100 + d + (window or 0))
    bs, lens = 16, [1, 31, 32, 33, 100, 129]
    kv = torch.randn(40, 1, 2, bs, hkv, d, generator=gen)
    layer = kv[:, 0].transpose(0, 1)  # [2, nb, bs, hkv, d]
    perm = torch.randperm(40, generator=gen).tolist()
    for a, b in [(0, 1), (2, 3), (4, 5)]:
        spans, row = [], 0
        for n in (lens[a], lens[b]):
            spans.append(PrefillSpan(row, n, n, torch.tensor(perm[: -(-n // bs)])))
            perm = perm[-(-n // bs) :] + perm[: -(-n // bs)]  # the next prompt's blocks differ
            row += n
        q = torch.randn(row, h, d, generator=gen)
        k = torch.cat([layer[0][s.block_table].flatten(0, 1)[: s.num_query] for s in spans])
        v = torch.cat([layer[1][s.block_table].flatten(0, 1)[: s.num_query] for s in spans])
        ctx = AttentionContext(torch.zeros(row, dtype=torch.long), spans, None, bs)
        assert cpu_attention.prefill_fits(q)
        ours = paged_attention(q, layer, ctx, 0.2, k, v, window)
        sdpa = paged_attention(q, layer, ctx, 0.2, k, v, window, cpu_kernel=False)
        torch.testing.assert_close(ours, sdpa)


def test_prefill_kernel_needs_whole_panels() -> None:
    """head_dim not a multiple of the kernel's panel width: prefill spans stay on SDPA."""
    assert not cpu_attention.prefill_fits(torch.zeros(3, 4, 80))
    assert cpu_attention.prefill_fits(torch.zeros(3, 4, 128))


@needs_compiler
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(("h", "hkv"), [(6, 2), (4, 1)])
def test_prefill_reads_q_through_its_row_stride(window: int | None, h: int, hkv: int) -> None:
    """The prefill kernel reads q as the layer hands it over, in place: a view of the qkv projection's output,
    tokens (h + 2 * hkv) * head_dim floats apart with K's and V's columns between. Its output equals the
    portable path's on a contiguous copy (a kernel that ignored the stride would read K's columns as queries)."""
    gen = torch.Generator().manual_seed(h + (window or 0))
    bs, d, num_query, context_len = 16, 32, 45, 70  # a chunk after 25 cached tokens
    kv = torch.randn(12, 1, 2, bs, hkv, d, generator=gen)
    layer = kv[:, 0].transpose(0, 1)  # [2, nb, bs, hkv, d]
    table = torch.randperm(12, generator=gen)[: -(-context_len // bs)]
    qkv = torch.randn(num_query, (h + 2 * hkv) * d, generator=gen)
    q = qkv[:, : h * d].view(num_query, h, d)
    assert q.stride(0) == (h + 2 * hkv) * d
    lib = cpu_kernels.library()
    assert lib is not None
    ours = cpu_attention.paged_prefill(lib, q, layer[0], layer[1], table, context_len, 0.3, window)
    span = PrefillSpan(0, num_query, context_len, table)
    ctx = AttentionContext(torch.zeros(num_query, dtype=torch.long), [span], None, bs)
    portable = paged_attention(q.contiguous(), layer, ctx, 0.3, None, None, window, cpu_kernel=False)
    torch.testing.assert_close(ours, portable)
