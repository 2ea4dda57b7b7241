"""Greedy generation through the offline LLM API equals transformers' generate(do_sample=False).

Covers batches of prompts of different lengths, chunked prefill (small token budget), preemption (few KV
blocks), prefix cache hits and block sizes 1/4/16, on tiny random models of several families.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams

MAX_TOKENS = 12


def _prompts(lengths: list[int], seed: int = 0, vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


_HF_MEMO: dict[tuple[int, tuple[int, ...], int], list[int]] = {}  # (id(model), prompt, max_tokens) -> tokens


def _hf_greedy(hf: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy continuation of one prompt (stops at EOS like the engine does), memoised."""
    key = (id(hf), tuple(prompt), max_tokens)
    if key not in _HF_MEMO:
        _HF_MEMO[key] = _hf_generate(hf, prompt, max_tokens)
    return _HF_MEMO[key]


def _hf_generate(hf: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _llm(folder: Path, **kw: Any) -> LLM:
    kw = {"num_blocks": 256, "max_num_seqs": 8, **kw}
    return LLM(str(folder), dtype="float32", device="cpu", **kw)


def _check(llm: LLM, hf: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[Any]:
    outs = llm.generate(prompts, SamplingParams.greedy(max_tokens))
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == _hf_greedy(hf, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
    return outs


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_matches_transformers(
    tiny_family: str, tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any], block_size: int
) -> None:
    llm = _llm(tiny_model_dirs[tiny_family], block_size=block_size, num_blocks=512 // block_size)
    _check(llm, hf_reference(tiny_family), _prompts([1, 5, 17, 40], seed=1))


def test_text_prompts_and_text(tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]) -> None:
    llm = _llm(tiny_model_dirs["llama"])
    assert llm.tokenizer is not None
    texts = ["Hello", "Paris is the capital of", "日本語"]
    outs = llm.generate(texts, SamplingParams.greedy(MAX_TOKENS))
    for text, out in zip(texts, outs, strict=True):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids and ids[0] == 1  # the llama tokenizer adds BOS
        assert out.token_ids == _hf_greedy(hf_reference("llama"), ids)
        # the streamed text can only differ from a one-shot decode by a trailing incomplete character
        full = llm.tokenizer.decode(out.token_ids)
        assert out.text == full.rstrip("\ufffd")


@pytest.mark.parametrize("budget", [3, 8, 16])
def test_chunked_prefill(tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any], budget: int) -> None:
    """A small max_num_batched_tokens splits every prompt into chunks across steps."""
    llm = _llm(tiny_model_dirs["qwen3"], block_size=4, max_num_batched_tokens=budget)
    _check(llm, hf_reference("qwen3"), _prompts([30, 9, 21], seed=budget))


def test_preemption(tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]) -> None:
    """Four sequences needing 4 x 8 blocks of 4 tokens share 14 blocks: some are preempted and recomputed."""
    llm = _llm(tiny_model_dirs["llama"], block_size=4, num_blocks=14, max_num_seqs=4)
    scheduler = llm.engine.scheduler
    preempted: list[str] = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda req: (preempted.append(req.request_id), preempt(req))[1]  # count, then preempt
    _check(llm, hf_reference("llama"), _prompts([10, 13, 7, 16], seed=5), max_tokens=16)
    assert preempted, "the test no longer exercises preemption"
    assert llm.engine.pool.num_free == 14  # every block came back


def test_more_prompts_than_running_slots(tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]) -> None:
    llm = _llm(tiny_model_dirs["mistral"], max_num_seqs=2)
    _check(llm, hf_reference("mistral"), _prompts([3, 8, 2, 12, 6], seed=6))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_cache_hits(
    tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any], block_size: int
) -> None:
    """Prompts sharing a 32-token prefix: later ones reuse its blocks and still generate the same tokens."""
    hf = hf_reference("qwen2")
    llm = _llm(tiny_model_dirs["qwen2"], block_size=block_size, num_blocks=1024 // block_size)
    prefix = _prompts([32], seed=7)[0]
    prompts = [prefix + tail for tail in _prompts([3, 9, 1], seed=8)]
    first = _check(llm, hf, prompts[:1])
    assert first[0].num_cached_tokens == 0
    later = _check(llm, hf, prompts[1:])
    for out in later:
        assert out.num_cached_tokens >= 32 - 32 % block_size - block_size  # full blocks of the shared prefix
        assert out.num_cached_tokens > 0
    again = _check(llm, hf, prompts[:1])  # the very same prompt: all but the last token may come from cache
    assert again[0].num_cached_tokens > 0


def test_prefix_caching_off_caches_nothing(
    tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any]
) -> None:
    llm = _llm(tiny_model_dirs["qwen2"], block_size=4, enable_prefix_caching=False)
    prompt = _prompts([20], seed=9)
    _check(llm, hf_reference("qwen2"), prompt)
    assert _check(llm, hf_reference("qwen2"), prompt)[0].num_cached_tokens == 0


@pytest.mark.slow
def test_builtin_model_answers_paris() -> None:
    """The real SmolLM2-135M-Instruct (GGUF, dequantized) through the LLM API and its chat template."""
    llm = LLM("smollm2-135m", num_blocks=64)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    out = llm.chat(question, SamplingParams.greedy(32))
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_builtin_model_matches_transformers() -> None:
    """Greedy tokens of the built-in model equal transformers' on the same (cached, dequantized) weights."""
    from transformers import AutoModelForCausalLM

    from pdserve.model.builtin import builtin_gguf_path
    from pdserve.model.loader import gguf_to_folder

    llm = LLM("smollm2-135m", num_blocks=64, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(gguf_to_folder(builtin_gguf_path("smollm2-135m"), "smollm2-135m"))
    assert llm.tokenizer is not None
    prompts = [llm.tokenizer.encode(t) for t in ("The first law of robotics", "def fib(n):")]
    outs = llm.generate(prompts, SamplingParams.greedy(8))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_greedy(hf.eval(), prompt, 8)
