"""Prompts of exact token length, seeded: random (unique per request) and shared-prefix (one document, many
questions). The multi-turn dataset, whose prompts depend on earlier answers, is multiturn.py.

Prompts are token-id lists, sent as the `prompt` of /v1/completions, so the server sees exactly the length
asked for (text would re-tokenize to a different length). In the random dataset each request's first token
differs from every other request's, so no prefix-cache hit shortcuts a prefill (block hashes chain from the
first block). In the shared-prefix dataset every prompt is the same document followed by its own question,
whose first token differs from every other question's: prompts share exactly the document's tokens.
For the chat endpoint the ids are decoded to text; the length the server reports in `usage` is what counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.bench.tokenizer import Vocab


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark run."""

    request_id: str  # sent as X-Request-Id; the servers' timelines are joined on it
    prompt: list[int] | str  # token ids (completions) or text (chat)
    prompt_len: int  # tokens in `prompt` as generated; the server's usage may correct it for text
    expected_output_len: int  # max_tokens for this request
    user: int = 0  # who sends it: the conversation (multiturn) or the request's index (other datasets)
    turn: int = 0  # its place in the user's conversation, from 0; always 0 outside multiturn


def sample_lengths(rng: np.random.Generator, num: int, length: int, range_ratio: float, minimum: int = 1) -> list[int]:
    """`num` lengths drawn uniformly from [length * (1 - r), length * (1 + r)] as `vllm bench serve` does."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if length < minimum:
        raise ValueError(f"length must be >= {minimum}, got {length}")
    low = max(minimum, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def random_requests(
    vocab: Vocab,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
    id_prefix: str | None = None,
) -> list[SampleRequest]:
    """`num_prompts` requests of random token ids; equal arguments give equal requests.

    Request ids are `<id_prefix>-<i>` (default prefix `bench<seed>`); give each run its own prefix and seed
    when one server sees several runs, or its prefix cache will recognise the repeated prompts.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    candidates = prompt_candidates(vocab)
    prompts = distinct_starts(rng, candidates, input_lens)
    return _requests(vocab, prompts, output_lens, as_text, id_prefix or f"bench{seed}")


def shared_prefix_requests(
    vocab: Vocab,
    num_prompts: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
    id_prefix: str | None = None,
) -> list[SampleRequest]:
    """`num_prompts` requests, each one document of `prefix_len` random tokens (the same in every request)
    followed by its own question of ~`question_len` tokens; equal arguments give equal requests.

    Questions start with distinct tokens while the vocabulary allows, so two prompts share exactly the
    document. Request ids as in `random_requests`; every request is its own user's only turn.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if prefix_len < 1:
        raise ValueError(f"shared prefix length must be >= 1, got {prefix_len}")
    rng = np.random.default_rng(seed)
    question_lens = sample_lengths(rng, num_prompts, question_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    candidates = prompt_candidates(vocab)
    document = [int(t) for t in rng.choice(candidates, size=prefix_len)]
    prompts = [document + question for question in distinct_starts(rng, candidates, question_lens)]
    return _requests(vocab, prompts, output_lens, as_text, id_prefix or f"bench{seed}")


def prompt_candidates(vocab: Vocab) -> np.ndarray:
    """The ids prompts are drawn from (every non-special id), [num_candidates]; refuses an empty vocabulary."""
    candidates = np.asarray(vocab.candidate_ids, dtype=np.int64)
    if candidates.size == 0:
        raise ValueError(f"{vocab.name}: no non-special token ids to draw prompts from")
    return candidates


def distinct_starts(rng: np.random.Generator, candidates: np.ndarray, lens: list[int]) -> list[list[int]]:
    """One random id list per length, first ids distinct while the vocabulary allows it: no two lists share
    a first token (so no two prompts that begin with them share a block)."""
    distinct = len(lens) <= candidates.size
    first_ids = rng.choice(candidates, size=len(lens), replace=not distinct)
    lists = []
    for first, length in zip(first_ids, lens, strict=True):
        rest = rng.choice(candidates, size=length - 1)
        lists.append([int(first), *(int(t) for t in rest)])
    return lists


def _requests(
    vocab: Vocab, prompts: list[list[int]], output_lens: list[int], as_text: bool, id_prefix: str
) -> list[SampleRequest]:
    """Request i of `prompts`: id `<id_prefix>-<i>`, user i, turn 0; text instead of ids when `as_text`."""
    requests = []
    for i, (ids, output_len) in enumerate(zip(prompts, output_lens, strict=True)):
        prompt: list[int] | str = vocab.decode(ids) if as_text else ids
        requests.append(SampleRequest(f"{id_prefix}-{i}", prompt, len(ids), output_len, user=i, turn=0))
    return requests
