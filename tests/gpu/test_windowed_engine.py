"""Sliding-window models on CUDA: windowed layers through cuda/attention.py (Triton decode from the window's first
block, tiled band prefill), Gemma 3 on the fused decoder, decode steps replayed from CUDA graphs with one
context per KV group. float32: greedy tokens equal transformers' for prompts and generations well past the
window, with graphs, eagerly, and on the portable decoder (whose attention still takes cuda/attention.py).

    pytest -m gpu tests/gpu/test_windowed_engine.py
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_engine import _check, _llm, _prompts

from pdserve import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
WINDOWED = ["gemma3", "mistral_swa", "qwen2_swa"]  # windows 6 (local layers), 10 (every layer), 7 (layer 1)


@pytest.mark.parametrize("family", WINDOWED)
def test_graphs_eager_and_portable_match_transformers(
    family: str, tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]
) -> None:
    hf = hf_reference(family)
    prompts = _prompts([3, 9, 25, 41], seed=12)  # 24 tokens each: every sequence runs past its window
    with_graphs = _llm(tiny_model_dirs[family], block_size=4)
    runner = with_graphs.engine.runner
    assert runner.graphs is not None and runner.decoder.uses_fused_kernels(torch.device("cuda"))
    assert runner.graphs.num_groups == runner.decoder.kv_groups.num_groups
    _check(with_graphs, hf, prompts, max_tokens=24)
    eager = _llm(tiny_model_dirs[family], block_size=4)
    eager.engine.runner.graphs = None
    _check(eager, hf, prompts, max_tokens=24)
    portable = _llm(tiny_model_dirs[family], block_size=16)
    portable.engine.runner.graphs = None
    portable.engine.runner.decoder.use_fused_kernels = False
    _check(portable, hf, prompts, max_tokens=24)


@pytest.mark.parametrize("budget", [5, 64])
def test_windowed_chunked_prefill_and_prefix_hits(
    tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any], budget: int
) -> None:
    """Prompts in chunks (each chunk gathers from the first block its first query sees) and a cached prefix
    longer than the window reused by later prompts, with graphs on."""
    hf = hf_reference("gemma3")
    llm = _llm(tiny_model_dirs["gemma3"], block_size=4, max_num_batched_tokens=budget)
    _check(llm, hf, _prompts([30, 13, 47], seed=budget), max_tokens=16)
    prefix = _prompts([36], seed=21)[0]
    _check(llm, hf, [prefix + [9]])
    outs = _check(llm, hf, [prefix + tail for tail in _prompts([3, 11], seed=22)])
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_windowed_graphs_and_eager_agree_bf16(tiny_model_dirs: dict[str, Path]) -> None:
    """bf16 gemma3: the captured decode steps produce the eager path's tokens (same kernels, padded batch)."""
    prompts = _prompts([3, 30, 11, 50, 7], seed=3)
    params = SamplingParams.greedy(32)
    with_graphs = _llm(tiny_model_dirs["gemma3"], "bfloat16", block_size=16)
    eager = _llm(tiny_model_dirs["gemma3"], "bfloat16", block_size=16)
    eager.engine.runner.graphs = None
    a, b = with_graphs.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
