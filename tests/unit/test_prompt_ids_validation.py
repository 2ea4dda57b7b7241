"""openai_request.py: a prompt's token ids checked at once (PromptIds) refuse and accept exactly what pydantic's
per-item `ge=0` constraint did, with the same 400 message, at any length."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from pdserve.openai_request import COMPLETIONS_PATH, TokenId, parse_request

PER_ITEM = TypeAdapter(list[TokenId])  # the rule as it was written before


def _per_item_accepts(ids: list[Any]) -> bool:
    try:
        PER_ITEM.validate_python(ids)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("seed", range(24))
def test_same_verdict_as_the_per_item_rule(seed: int) -> None:
    rng = random.Random(seed)
    length = rng.choice([2, 3, 16384])  # (not 1: a list of one prompt, such as ["3"], is that prompt)
    ids: list[Any] = [rng.randrange(151936) for _ in range(length)]
    odd = [-1, -(2**63), -(2**70), 2**63, 2**64, 2**70, True, False, 1.0, "3", None, [1]][seed % 12]
    if seed >= 12:
        ids[rng.randrange(len(ids))] = odd
    accepted = _per_item_accepts(ids)
    try:
        parsed = parse_request(COMPLETIONS_PATH, {"prompt": ids})
    except ValueError as e:
        assert not accepted, ids[:5]
        assert "prompt: must be a string, a list of token ids (integers >= 0)" in str(e)
        return
    assert accepted, odd
    assert parsed.prompt == ids


def test_a_negative_id_anywhere_in_a_long_prompt_is_a_400() -> None:
    ids = list(range(16384))
    for where in (0, 8191, 16383):
        bad = list(ids)
        bad[where] = -1
        with pytest.raises(ValueError, match="integers >= 0"):
            parse_request(COMPLETIONS_PATH, {"prompt": bad})
        with pytest.raises(ValueError, match="integers >= 0"):
            parse_request(COMPLETIONS_PATH, {"prompt": [bad]})  # a one-prompt list
    big = [2**64 + 5, *ids[:10]]  # no error here: the engine's vocabulary refuses it (the router passes it on)
    assert parse_request(COMPLETIONS_PATH, {"prompt": big}).prompt == big
