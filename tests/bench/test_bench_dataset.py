"""Prompts of exact token length, unique first tokens, seeded; the client's chunk accounting."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.bench.client import ClientConfig, build_payload, count_tokens
from pdserve.bench.dataset import random_requests, sample_lengths
from pdserve.bench.tokenizer import load_vocab


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, make_byte_tokenizer: Callable[..., Any]) -> Path:
    path = tmp_path_factory.mktemp("byte-tokenizer")
    make_byte_tokenizer(add_bos=True).save_pretrained(path)
    return path


def test_exact_lengths_and_unique_first_tokens(byte_tokenizer_dir: Path) -> None:
    vocab = load_vocab(str(byte_tokenizer_dir))
    assert vocab.vocab_size == 261 and {0, 1, 2} <= vocab.special_ids
    reqs = random_requests(vocab, num_prompts=200, input_len=37, output_len=9, seed=1)
    assert [len(r.prompt) for r in reqs] == [37] * 200
    assert [r.prompt_len for r in reqs] == [37] * 200
    assert [r.expected_output_len for r in reqs] == [9] * 200
    assert len({r.prompt[0] for r in reqs}) == 200  # no two prompts share a first block
    assert len({r.request_id for r in reqs}) == 200
    for r in reqs:
        assert all(isinstance(t, int) and t not in vocab.special_ids and 0 <= t < 261 for t in r.prompt)


def test_seeded(byte_tokenizer_dir: Path) -> None:
    vocab = load_vocab(str(byte_tokenizer_dir))
    a = random_requests(vocab, 5, 16, 4, seed=7)
    assert a == random_requests(vocab, 5, 16, 4, seed=7)
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(vocab, 5, 16, 4, seed=8)]


def test_range_ratio(byte_tokenizer_dir: Path) -> None:
    vocab = load_vocab(str(byte_tokenizer_dir))
    reqs = random_requests(vocab, 300, input_len=100, output_len=20, range_ratio=0.5, seed=0)
    input_lens = [len(r.prompt) for r in reqs]
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(set(input_lens)) > 20
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    with pytest.raises(ValueError):
        sample_lengths(np.random.default_rng(0), 3, 10, 1.0)


def test_text_prompts_for_chat(byte_tokenizer_dir: Path) -> None:
    vocab = load_vocab(str(byte_tokenizer_dir))
    (req,) = random_requests(vocab, 1, 24, 4, seed=0, as_text=True)
    assert isinstance(req.prompt, str) and req.prompt
    cfg = ClientConfig(api_url="http://x/v1/chat/completions", model="m", is_chat=True, ignore_eos=True)
    body = build_payload(cfg, req)
    assert body["messages"] == [{"role": "user", "content": req.prompt}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]


def test_config_only_folder_gives_vocab_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 50, "bos_token_id": 1, "eos_token_id": [2, 3]}')
    vocab = load_vocab(str(tmp_path))
    assert vocab.vocab_size == 50 and vocab.special_ids == {1, 2, 3} and vocab.tokenizer is None
    (req,) = random_requests(vocab, 1, 10, 2)
    assert all(4 <= t < 50 or t == 0 for t in req.prompt)


def test_chunk_token_counts() -> None:
    assert count_tokens({"text": "ab", "finish_reason": None}, is_chat=False) == 1
    assert count_tokens({"text": "", "finish_reason": "length"}, is_chat=False) == 0  # bare finish marker
    assert count_tokens({"text": "", "finish_reason": "length", "token_ids": [4, 5]}, is_chat=False) == 2
    assert count_tokens({"text": "", "finish_reason": None}, is_chat=False) == 1  # a special token
    assert count_tokens({"delta": {"role": "assistant", "content": ""}}, is_chat=True) == 0
    assert count_tokens({"delta": {"content": "x"}, "finish_reason": None}, is_chat=True) == 1
    assert count_tokens({"delta": {}, "finish_reason": "stop"}, is_chat=True) == 0
