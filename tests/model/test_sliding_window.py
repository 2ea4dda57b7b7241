"""Sliding-window and hybrid models: the window boundary, greedy output equal to transformers' for prompts and
generations well past the window (chunked prefill and prefix hits included), and the KV groups' block tables
(a windowed group keeps only the blocks its window can read; every block comes back)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generate import _hf_greedy, _llm, _prompts

from pdserve import LLM, SamplingParams
from pdserve.kv.groups import STALE, KVGroups
from pdserve.model.attention import paged_attention
from pdserve.model.paged import AttentionContext, DecodeBatch, PrefillSpan

WINDOWED = ["mistral_swa", "qwen2_swa", "gemma3"]  # windows 10, 7 (layer 1 only), 6 (layers 0 and 2)


@pytest.mark.parametrize("window", [1, 3, 4, 9])
def test_window_boundary(window: int) -> None:
    """The query at position p attends to keys (p - window, p] (transformers' sliding_window_overlay), in a
    whole prompt, a chunk after cached tokens and a decode row alike."""
    gen = torch.Generator().manual_seed(window)
    bs, n, h, d = 4, 13, 2, 8
    k, v, q = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    cache = torch.zeros(2, 8, bs, h, d)
    table = torch.tensor([5, 2, 7, 0])  # shuffled blocks
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    cache[0].view(-1, h, d)[slots], cache[1].view(-1, h, d)[slots] = k, v
    qpos, kpos = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    mask = (kpos <= qpos) & (kpos > qpos - window)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    whole = AttentionContext(slots, [PrefillSpan(0, n, n, table)], None, bs)
    got = paged_attention(q, cache, whole, 0.5, k, v, window)
    torch.testing.assert_close(got, expected)
    chunk = AttentionContext(slots[6:], [PrefillSpan(0, n - 6, n, table)], None, bs)
    torch.testing.assert_close(paged_attention(q[6:], cache, chunk, 0.5, None, None, window), expected[6:])
    stale = table.clone()
    stale[: max(0, n - window) // bs] = 99  # entries before the window are never read (99 is out of range)
    decode = DecodeBatch(torch.tensor([0]), stale.unsqueeze(0), torch.tensor([n]), n)
    got = paged_attention(q[-1:], cache, AttentionContext(slots[-1:], [], decode, bs), 0.5, None, None, window)
    torch.testing.assert_close(got, expected[-1:])


def test_kv_groups() -> None:
    """Gemma 3 12B's pattern: 40 local and 8 global layers make six groups of 8 layers, the global one first."""
    windows = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(48))
    groups = KVGroups.of(windows, 48)
    assert groups.layers_per_block == 8 and groups.num_groups == 6
    assert groups.groups[0].window is None and groups.groups[0].layers == tuple(range(5, 48, 6))
    assert groups.layer_slots()[0] == (1, 0) and groups.layer_slots()[5] == (0, 0)
    assert groups.first_live_block(1, 2048, 16) == (2048 - 1024 + 1) // 16 and groups.first_live_block(0, 2048, 16) == 0
    assert KVGroups.of((), 3).layers_per_block == 3 and not KVGroups.of((), 3).is_windowed


def _check_live_blocks(llm: LLM, window_of: list[int | None], block_size: int) -> None:
    """Every running request's windowed tables hold at most ceil(window / block_size) + 1 live blocks."""
    for req in llm.engine.scheduler.running:
        for table, window in zip(req.block_tables, window_of, strict=True):
            live = [b for b in table if b != STALE]
            if window is None:
                assert len(live) == len(table)
            else:
                assert len(live) <= -(-window // block_size) + 1, (window, table)


@pytest.mark.parametrize("family", WINDOWED)
def test_generate_past_the_window(
    family: str, tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]
) -> None:
    """Prompts and 40 generated tokens far past the window, prefilled in chunks of 7 tokens, equal transformers'
    greedy output; the windowed groups' early blocks are freed while the requests run."""
    llm = _llm(tiny_model_dirs[family], block_size=4, num_blocks=96, max_num_batched_tokens=7)
    groups = llm.engine.runner.decoder.kv_groups
    window_of = [g.window for g in groups.groups]
    prompts = _prompts([30, 57, 3], seed=11)
    for p in prompts:
        llm.engine.add_request(f"r{len(p)}", p, SamplingParams.greedy(40))
    outs: dict[str, list[int]] = {}
    peak_free = 0
    while llm.engine.has_work():
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        _check_live_blocks(llm, window_of, 4)
        peak_free = max(peak_free, llm.engine.pool.num_free)
    hf = hf_reference(family)
    for p in prompts:
        assert outs[f"r{len(p)}"] == _hf_greedy(hf, p, 40), f"prompt of {len(p)} tokens"
    assert llm.engine.pool.num_free == llm.engine.num_blocks


@pytest.mark.parametrize("family", WINDOWED)
def test_prefix_hits_past_the_window(
    family: str, tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]
) -> None:
    """Prompts sharing a 33-token prefix: later ones resume from the cached blocks (a windowed group's hit needs
    only its window's blocks) and still generate transformers' tokens."""
    hf = hf_reference(family)
    llm = _llm(tiny_model_dirs[family], block_size=4, num_blocks=128)
    prefix = _prompts([33], seed=12)[0]
    prompts = [prefix + tail for tail in _prompts([2, 11], seed=13)]
    first = llm.generate(prompts[:1], SamplingParams.greedy(20))[0]
    assert first.token_ids == _hf_greedy(hf, prompts[0], 20)
    later = llm.generate(prompts[1:], SamplingParams.greedy(20))[0]
    assert later.token_ids == _hf_greedy(hf, prompts[1], 20)
    assert later.num_cached_tokens == 32
    again = llm.generate(prompts[:1], SamplingParams.greedy(20))[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 32
    assert llm.engine.pool.num_free == 128
