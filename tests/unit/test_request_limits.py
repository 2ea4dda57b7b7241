"""engine/limits.py: the vectorized token-id check refuses exactly what the per-id loop refused, with its message."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.limits import RequestLimits

LIMITS = RequestLimits(vocab_size=1000, max_model_len=20000, block_size=16, num_blocks=2000)


def _reference(ids: list) -> str | None:
    """What the old loop said: the first id outside [0, vocab) (None: all good)."""
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < LIMITS.vocab_size)]
    return None if not bad else repr(bad[0])


@pytest.mark.parametrize("seed", range(20))
def test_same_verdict_as_the_loop(seed: int) -> None:
    rng = random.Random(seed)
    ids: list = [rng.randrange(LIMITS.vocab_size) for _ in range(rng.choice([1, 15, 16384]))]
    if seed % 2:  # one bad id somewhere (a later one too when seed % 4 == 3)
        bad = [-1, LIMITS.vocab_size, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, "7", None][seed % 10]
        ids[rng.randrange(len(ids))] = bad
        if seed % 4 == 3:
            ids.append(LIMITS.vocab_size + 5)
    expected = _reference(ids)
    if expected is None:
        LIMITS.check(ids)
        LIMITS.check(tuple(ids))
        return
    with pytest.raises(ValueError, match="token id") as e:
        LIMITS.check(ids)
    assert f"token id {expected} " in str(e.value)


def test_edges() -> None:
    LIMITS.check([0, LIMITS.vocab_size - 1])
    for ids, message in (
        ([LIMITS.vocab_size], "token id 1000 is outside the vocabulary [0, 1000)"),
        ([5, -1], "token id -1 is outside the vocabulary"),
        ([2**64 + 3], "outside the vocabulary"),  # past uint64: the packing refuses it
        ([1, 2.0], "token id 2.0 is not an integer"),
    ):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
            LIMITS.check(ids)
    with pytest.raises(ValueError, match="prompt is empty"):
        LIMITS.check([])
