"""Tensor parallelism on the CPU (gloo): a TP 2 engine generates exactly what the TP 1 engine does.

TP 1 stays checked against transformers (test_generate.py); here TP 2 is checked against TP 1, greedy, token
for token, float32, with chunked prefill, decode batches and prefix-cache hits, on a Llama whose 2 KV heads
split over the ranks, a Mistral whose 1 KV head is replicated, and two models of several KV groups (Gemma 3's
local + global layers, Qwen2 with max_window_layers), generating past their windows: the step plan carries
every group's table, STALE entries included. Each TP 2 engine spawns a rank process
(seconds on a busy machine), so the tests share engines and keep to one torch thread per rank.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig, TransferConfig
from pdserve.engine.kv_cache import allocate_kv_cache
from pdserve.engine.runner import ModelRunner
from pdserve.engine.tp.group import TPGroupError
from pdserve.engine.tp.step_plan import SHUTDOWN, PlanChunk, PlanError, PlanKind, StepPlan, decode, encode
from pdserve.kv.groups import STALE, KVGroups
from pdserve.model.arch import ModelArch
from pdserve.model.loader import load_model, model_arch
from pdserve.model.parallel import shard_for, shard_param

MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(5, 320, (20,), generator=gen).tolist()  # a prefix later prompts hit in the cache
    tails = [torch.randint(5, 320, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    return [shared, *(shared + t for t in tails), [7]]


def _generate(folder: Path, tp: int) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        num_threads=1,
        block_size=4,
        num_blocks=96,
        max_num_batched_tokens=24,  # prompts are prefilled in chunks, mixed with decodes
    )
    first = llm.generate(_prompts()[:1], SamplingParams.greedy(MAX_TOKENS))
    rest = llm.generate(_prompts()[1:], SamplingParams.greedy(MAX_TOKENS))
    assert rest[0].num_cached_tokens > 0, "the test no longer exercises prefix-cache hits"
    return llm, [o.token_ids for o in first + rest]


# llama: 2 KV heads split; mistral: 1 KV head replicated; gemma3 (window 6), qwen2_swa (7): 2 KV groups
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "qwen2_swa"])
def test_tp2_equals_tp1(tiny_model_dirs: dict[str, Path], family: str) -> None:
    ref, expected = _generate(tiny_model_dirs[family], 1)
    ref.shutdown()
    llm, got = _generate(tiny_model_dirs[family], 2)
    try:
        assert llm.engine.runner.decoder.shard.num_kv_heads == 1  # llama: 2 / 2; mistral: 1, replicated
        groups = llm.engine.runner.decoder.kv_groups
        assert groups.num_groups == (2 if family in ("gemma3", "qwen2_swa") else 1)
        if groups.is_windowed:  # the longest prompt and its generation run well past every window
            assert max(len(p) for p in _prompts()) + MAX_TOKENS > 4 * max(w or 0 for w in groups.windows)
        assert got == expected
        assert llm.engine.pool.num_free == llm.engine.num_blocks
        if family == "mistral":  # a rank that dies: the next step fails at once, naming it, and never hangs
            rank = llm.engine.ranks
            assert rank is not None
            pid = rank.procs[0].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            rank.procs[0].join(10)
            started = time.monotonic()
            with pytest.raises(TPGroupError, match="tensor-parallel rank 1"):
                llm.generate(_prompts()[:1], SamplingParams.greedy(2))
            assert time.monotonic() - started < 10
            with pytest.raises(TPGroupError):  # broken for good
                llm.generate(_prompts()[:1], SamplingParams.greedy(2))
    finally:
        llm.shutdown()
    assert llm.engine.ranks is not None and not llm.engine.ranks.procs  # every rank joined


def test_sharded_dummy_weights_match(tmp_path: Path) -> None:
    """Dummy weights do not depend on the TP size: each rank keeps its slice of TP 1's (vocab padded)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "vocab_size": 101,  # not divisible by 2: the last rank's slice is padded
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(model=str(folder), load_format="dummy", seed=5)
    whole = dict(load_model(cfg).decoder.named_parameters())
    for rank in range(2):
        part = load_model(cfg, 2, rank, comm=_NoCollectives()).decoder
        for name, param in part.named_parameters():
            assert torch.equal(param, shard_param(name, whole[name], part.arch, part.shard)), (rank, name)
        assert part.embed_tokens.weight.shape[0] == 51


class _NoCollectives:
    """Collectives for a decoder that is only loaded, never run."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not expected")

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not expected")


def _arch(heads: int, kv_heads: int) -> ModelArch:
    return ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 16 * heads,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


def test_head_split_and_replication() -> None:
    s = [shard_for(_arch(8, 2), 4, r) for r in range(4)]  # 4 ranks, 2 KV heads: each on 2 ranks
    assert [(x.head_start, x.num_heads, x.kv_head_start, x.num_kv_heads) for x in s] == [
        (0, 2, 0, 1),
        (2, 2, 0, 1),
        (4, 2, 1, 1),
        (6, 2, 1, 1),
    ]
    s2 = [shard_for(_arch(8, 4), 2, r) for r in range(2)]
    assert [(x.kv_head_start, x.num_kv_heads) for x in s2] == [(0, 2), (2, 2)]


def test_refuses_heads_that_cannot_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 does not divide the model's 3 attention heads"):
        shard_for(_arch(3, 3), 2)
    with pytest.raises(ConfigError, match=r"3 KV heads \(6 attention heads\)"):
        shard_for(_arch(6, 3), 2)
    folder = tmp_path / "three-heads"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64}
    config |= {"num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 3}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="3 attention heads"):  # refused before any rank is spawned
        LLM(str(folder), load_format="dummy", tensor_parallel_size=2)


def test_config_allows_disaggregated_tp() -> None:
    for role in ("prefill", "decode"):
        for mode in ("pull", "push"):
            EngineConfig(ModelConfig("x"), transfer=TransferConfig(role=role, mode=mode), parallel=ParallelConfig(2))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(0)


def test_step_plan_round_trip() -> None:
    plan = StepPlan(PlanKind.STEP, [PlanChunk([5, 6, 7], 0, [[3]], False), PlanChunk([9], 12, [[4, 8, 1, 2]], True)])
    assert decode(encode(plan)) == plan
    # several KV groups, a windowed group's STALE entries before its window included
    groups = StepPlan(PlanKind.STEP, [PlanChunk([9], 12, [[4, 8, 1, 2], [STALE, STALE, 6, 7]], True),
                                      PlanChunk([1, 2], 0, [[5], [3]], False)])  # fmt: skip
    assert decode(encode(groups)) == groups
    with pytest.raises(PlanError, match="differ in length"):
        encode(StepPlan(PlanKind.STEP, [PlanChunk([9], 12, [[4, 8, 1, 2], [6, 7]], True)]))
    bad = encode(StepPlan(PlanKind.STEP, [PlanChunk([9], 0, [[4], [-2]], True)]))
    with pytest.raises(PlanError, match="neither a block nor STALE"):
        decode(bad)
    assert decode(encode(SHUTDOWN)) == SHUTDOWN
    transfer = StepPlan(PlanKind.TRANSFER, [], b"\x81\xa1v\x01")
    assert decode(encode(transfer)) == transfer
    data = encode(plan)
    with pytest.raises(PlanError, match="version"):
        decode((99).to_bytes(8, "little") + data[8:])
    with pytest.raises(PlanError, match="do not add up"):
        decode(data[:-8])


class _ThreadCollectives:
    """Collectives between ranks that are threads of this process (every rank sums in the same order)."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.shared = rank, shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait(timeout=30)
        parts = list(slots)
        barrier.wait(timeout=30)  # nobody overwrites a slot before every rank read them all
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        return x.copy_(functools.reduce(torch.add, parts))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)


def test_every_family_tp2_logits_equal_tp1(tiny_family: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Each family's shard layout (qkv bias, q/k norm, tied embeddings, llama3 RoPE, GQA/MQA) in-process:
    two ranks as threads give TP 1's logits, for a chunked prefill followed by a decode step."""
    cfg = ModelConfig(model=str(tiny_model_dirs[tiny_family]), num_threads=1)
    arch = model_arch(cfg)
    groups = KVGroups.of(arch.layer_windows, arch.num_layers)

    def tables(blocks: list[int], num_computed: int) -> list[list[int]]:
        """Group g's table: the blocks + 8 g, STALE before a windowed group's window (as the scheduler frees)."""
        out = []
        for g in range(groups.num_groups):
            first = groups.first_live_block(g, num_computed, 4)
            out.append([STALE] * first + [b + 8 * g for b in blocks[first:]])
        return out

    steps = [
        [PlanChunk(list(range(5, 21)), 0, tables([3, 1, 4, 0], 0), False),
         PlanChunk(list(range(40, 45)), 0, tables([5, 2], 0), True)],
        [PlanChunk(list(range(21, 27)), 16, tables([3, 1, 4, 0, 6, 7], 16), True),
         PlanChunk([50], 5, tables([5, 2], 5), True)],
    ]  # fmt: skip
    if groups.is_windowed:  # the second step's first chunk starts past a window: its first entries are STALE
        assert any(STALE in t for t in steps[1][0].block_tables)

    def run(tp: int, rank: int, comm: _ThreadCollectives | None, out: dict[int, list[torch.Tensor]]) -> None:
        loaded = load_model(cfg, tp, rank, comm)
        heads = loaded.decoder.shard.num_kv_heads
        kv = allocate_kv_cache(loaded.arch, 8 * groups.num_groups, 4, torch.float32, torch.device("cpu"), heads)
        runner = ModelRunner(loaded.decoder, kv, torch.device("cpu"))
        out[rank] = [logits for s in steps if (logits := runner.forward(s)) is not None]

    expected: dict[int, list[torch.Tensor]] = {}
    run(1, 0, None, expected)
    shared: dict[str, Any] = {"slots": [None, None], "barrier": threading.Barrier(2)}
    got: dict[int, list[torch.Tensor]] = {}
    threads = [threading.Thread(target=run, args=(2, r, _ThreadCollectives(r, shared), got)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(got) == {0, 1}
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_staged_pull_prefill_with_tp_is_refused() -> None:
    """A TP pull prefill staging through host memory could answer before ranks >= 1 filled their mirror."""
    from pdserve.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig, TransferConfig

    with pytest.raises(ConfigError, match="kv-buffer-device cpu with --tensor-parallel-size"):
        EngineConfig(
            model=ModelConfig(model="qwen3-0.6b", device="cuda"),
            transfer=TransferConfig(role="prefill", mode="pull", kv_buffer_device="cpu"),
            parallel=ParallelConfig(2),
        )
    EngineConfig(  # the same on a decode instance, or without staging, is fine
        model=ModelConfig(model="qwen3-0.6b", device="cuda"),
        transfer=TransferConfig(role="decode", mode="pull", kv_buffer_device="cpu"),
        parallel=ParallelConfig(2),
    )
