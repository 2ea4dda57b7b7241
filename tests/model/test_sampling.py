"""Sampling and stop conditions through the offline API on a tiny random Llama with a byte tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import sample

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, Path]) -> LLM:
    return LLM(str(tiny_model_dirs["llama"]), num_threads=1)


def test_stop_string_cuts_text_and_finishes(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams.greedy(24, ignore_eos=True))[0]
    text = full.text
    cut = next(
        (i for i in range(3, len(text) - 2) if text[i : i + 2].strip() and text[i : i + 2] not in text[:i]), None
    )
    if cut is None:
        pytest.skip(f"generated text {text!r} has no unique 2-char substring to stop on")
    stop = text[cut : cut + 2]
    out = llm.generate([PROMPT], SamplingParams.greedy(24, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_is_kept_in_tokens(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams.greedy(12, ignore_eos=True))[0].token_ids
    target = full[3]
    first = full.index(target)
    out = llm.generate([PROMPT], SamplingParams.greedy(12, ignore_eos=True, stop_token_ids=(target,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: first + 1]


def test_max_tokens_gives_length(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams.greedy(5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm: LLM) -> None:
    def run(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        return llm.generate([PROMPT], p)[0].token_ids

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams.greedy(10, ignore_eos=True))[0].token_ids
    topk = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.8, top_k=1, ignore_eos=True))
    assert topk[0].token_ids == greedy


def test_sampler_top_p_and_top_k_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 200)
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=i) for i in range(200)]
    assert set(sample(logits, params, [0] * 200)) == {0}  # token 0 alone holds > 50% of the mass
    params = [SamplingParams(temperature=5.0, top_k=2, seed=i) for i in range(200)]
    assert set(sample(logits, params, [0] * 200)) == {0, 1}


def test_bad_sampling_params_are_refused() -> None:
    for kw in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6, 5e-324])
def test_tiny_temperature_is_greedy(llm: LLM, temperature: float) -> None:
    greedy = llm.generate([PROMPT], SamplingParams.greedy(8, ignore_eos=True))[0].token_ids
    params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
    assert params.is_greedy
    assert llm.generate([PROMPT], params)[0].token_ids == greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -math.inf),
        ("temperature", -1e-40),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("top_p", -0.5),
        ("top_p", 1.5),
        ("top_k", -5),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("seed", 1.5),
        ("stop_token_ids", (-1,)),
    ],
)
def test_bad_value_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampler_never_raises_on_extreme_logits() -> None:
    vocab = 16
    rows = [
        torch.full((vocab,), 3.4e38),  # overflows when divided by a small temperature
        torch.tensor([1e30, -1e30] * (vocab // 2)),
        torch.tensor([float("nan")] * vocab),
        torch.tensor([float("inf"), 0.0] * (vocab // 2)),
        torch.tensor([float("-inf")] * vocab),
        torch.tensor([float("-inf")] * (vocab - 1) + [0.0]),
    ]
    logits = torch.stack(rows)
    for params in (
        SamplingParams(temperature=2e-5),
        SamplingParams(temperature=1.0, top_p=1e-9, seed=1),
        SamplingParams(temperature=1e30, top_k=3),
    ):
        ids = sample(logits, [params] * len(rows), [0] * len(rows))
        assert all(isinstance(t, int) and 0 <= t < vocab for t in ids)
    assert sample(logits[-1:], [SamplingParams(temperature=1.0)], [0]) == [vocab - 1]
    bf16 = torch.tensor([[0.0, 50.0, 1.0]], dtype=torch.bfloat16)
    assert sample(bf16, [SamplingParams(temperature=1e-4)], [0]) == [1]
