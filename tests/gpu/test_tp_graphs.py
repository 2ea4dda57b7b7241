"""CUDA graphs with tensor parallelism (two GPUs): every rank replays the same captured decode step, NCCL
collectives inside, and the tokens equal the eager TP 2 run and TP 1 (float32: Triton dots in IEEE mode,
cuBLAS without TF32, so only the ranks' partial sums round differently, which these margins absorb)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.tp.group import TPGroupError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 320, (n,), generator=gen).tolist() for n in lengths]


def _run(folder: Path, prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], int]:
    llm = LLM(str(folder), device="cuda", num_blocks=256, max_num_seqs=16, block_size=16, **kw)
    try:
        outs = llm.generate(prompts, SamplingParams.greedy(24))
        graphs = llm.engine.runner.graphs
        return [o.token_ids for o in outs], (graphs.replays if graphs is not None else -1)
    finally:
        llm.shutdown()


# split KV heads (2 over 2 ranks); one replicated; several KV groups (windows 6 and 7, every plan carries both
# groups' tables, STALE entries included: the prompts run past the windows)
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3", "qwen2_swa"])
def test_tp2_graphs_equal_eager_and_tp1(tiny_model_dirs: dict[str, Path], family: str) -> None:
    prompts = _prompts([3, 30, 11, 50, 7, 19, 2, 64, 5], seed=11)  # 9 rows: buckets 16 down to 1 as they end
    graphs, replays = _run(tiny_model_dirs[family], prompts, tensor_parallel_size=2)
    eager, none = _run(tiny_model_dirs[family], prompts, tensor_parallel_size=2, enforce_eager=True)
    tp1, _ = _run(tiny_model_dirs[family], prompts)
    assert replays > 0 and none == -1
    assert graphs == eager
    assert graphs == tp1


def test_rank_killed_mid_decode_fails_fast(tiny_model_dirs: dict[str, Path]) -> None:
    """Rank 1 killed while rank 0 replays decode graphs (and so waits inside NCCL all-reduces for it): the
    watch thread aborts rank 0's communicator, generate() raises TPGroupError within seconds, not never."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cuda", num_blocks=512, max_num_seqs=16, tensor_parallel_size=2)
    try:
        prompts = _prompts([5] * 16, seed=3)
        llm.generate(prompts, SamplingParams.greedy(4))
        assert llm.engine.ranks is not None
        pid = llm.engine.ranks.procs[0].pid
        assert pid is not None
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(TPGroupError, match="rank 1"):
            for _ in range(100):
                llm.generate(prompts, SamplingParams.greedy(240, ignore_eos=True))
        assert time.monotonic() - started < 20
    finally:
        llm.shutdown()
