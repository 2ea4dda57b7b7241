"""Random prompts of exact token length, unique per request, seeded.

Prompts are token-id lists, sent as the `prompt` of /v1/completions, so the server sees exactly the length
asked for (text would re-tokenize to a different length). Each request's first token differs from every
other request's, so no prefix-cache hit shortcuts a prefill (block hashes chain from the first block).
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
    candidates = np.asarray(vocab.candidate_ids, dtype=np.int64)  # [num_candidates]
    if candidates.size == 0:
        raise ValueError(f"{vocab.name}: no non-special token ids to draw prompts from")
    # distinct first tokens while the vocabulary allows it: no two prompts share a first block
    distinct = num_prompts <= candidates.size
    first_ids = rng.choice(candidates, size=num_prompts, replace=not distinct)
    requests = []
    for i in range(num_prompts):
        rest = rng.choice(candidates, size=input_lens[i] - 1)
        ids = [int(first_ids[i]), *(int(t) for t in rest)]
        prompt: list[int] | str = vocab.decode(ids) if as_text else ids
        requests.append(
            SampleRequest(
                request_id=f"{id_prefix or f'bench{seed}'}-{i}",
                prompt=prompt,
                prompt_len=len(ids),
                expected_output_len=output_lens[i],
            )
        )
    return requests
