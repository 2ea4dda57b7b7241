"""The Decoder over a paged KV cache matches transformers' forward pass (float32) for every family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_step import PagedCache, step

from pdserve.config import ModelConfig
from pdserve.model.loader import LoadedModel, load_model

ATOL = 1e-4


def _prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(5, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture
def loaded(tiny_family: str, tiny_model_dirs: dict[str, Path]) -> LoadedModel:
    return load_model(ModelConfig(model=str(tiny_model_dirs[tiny_family])))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_matches_transformers(
    loaded: LoadedModel, tiny_family: str, hf_reference: Callable[[str], Any], block_size: int
) -> None:
    hf = hf_reference(tiny_family)
    cache = PagedCache(loaded.arch, num_blocks=(1 + 7 + 16 + 33 + 120) // block_size + 8, block_size=block_size)
    for seq, length in enumerate([1, 7, 16, 33, 120]):
        ids = _prompt(length, seed=seq)
        (ours,) = step(loaded.decoder, cache, [(seq, ids)], use_decode_batch=False)
        torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_chunked_prefill_matches_transformers(
    loaded: LoadedModel, tiny_family: str, hf_reference: Callable[[str], Any], split: int
) -> None:
    """A prompt computed in two chunks: the second attends to the first chunk's cached KV."""
    hf = hf_reference(tiny_family)
    ids = _prompt(29, seed=3)
    expected = _hf_logits(hf, ids)
    cache = PagedCache(loaded.arch, num_blocks=16, block_size=4)
    (first,) = step(loaded.decoder, cache, [(0, ids[:split])], use_decode_batch=False)
    (second,) = step(loaded.decoder, cache, [(0, ids[split:])], use_decode_batch=False)
    torch.testing.assert_close(first, expected[:split], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, expected[split:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_batch_matches_transformers(
    loaded: LoadedModel, tiny_family: str, hf_reference: Callable[[str], Any], block_size: int
) -> None:
    """Three sequences of different lengths prefilled in one step, then decoded together for four steps."""
    hf = hf_reference(tiny_family)
    prompts = [_prompt(n, seed=10 + n) for n in (5, 17, 2)]
    cache = PagedCache(loaded.arch, num_blocks=64 // block_size + 12, block_size=block_size)
    step(loaded.decoder, cache, list(enumerate(prompts)), use_decode_batch=False)
    seqs = [list(p) for p in prompts]
    for t in range(4):
        new = [_prompt(1, seed=100 * t + i)[0] for i in range(len(seqs))]
        outs = step(loaded.decoder, cache, [(i, [tok]) for i, tok in enumerate(new)])
        for i, tok in enumerate(new):
            seqs[i].append(tok)
            torch.testing.assert_close(outs[i][0], _hf_logits(hf, seqs[i])[-1], atol=ATOL, rtol=0)


def test_mixed_step_matches_transformers(
    loaded: LoadedModel, tiny_family: str, hf_reference: Callable[[str], Any]
) -> None:
    """One forward holding decode rows, a prompt's second chunk and a new prompt, interleaved."""
    hf = hf_reference(tiny_family)
    a, b, c, d = (_prompt(n, seed=20 + n) for n in (6, 11, 19, 9))
    cache = PagedCache(loaded.arch, num_blocks=32, block_size=4)
    step(loaded.decoder, cache, [(0, a[:-1]), (1, b[:-1]), (2, c[:8])], use_decode_batch=False)
    outs = step(loaded.decoder, cache, [(0, a[-1:]), (2, c[8:]), (1, b[-1:]), (3, d)])
    expected = [_hf_logits(hf, s)[-n:] for s, n in ((a, 1), (c, len(c) - 8), (b, 1), (d, len(d)))]
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, atol=ATOL, rtol=0)


def test_single_token_prefill_equals_decode_path(loaded: LoadedModel) -> None:
    """The same new token through a PrefillSpan and through the DecodeBatch gives the same logits."""
    ids = _prompt(10, seed=7)
    results = []
    for use_decode_batch in (False, True):
        cache = PagedCache(loaded.arch, num_blocks=8, block_size=4)
        step(loaded.decoder, cache, [(0, ids[:-1])], use_decode_batch=False)
        results.append(step(loaded.decoder, cache, [(0, ids[-1:])], use_decode_batch=use_decode_batch)[0])
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)
