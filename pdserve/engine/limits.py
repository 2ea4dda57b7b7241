"""The fixed limits a request is checked against before it is queued (any thread: nothing here changes).

The server's event loop checks a request here before handing it to the engine thread (async_engine.py), which
adds it without checking again (the limits are fixed); LLMEngine.add_request checks its other callers' requests.
Each refusal is a ValueError whose message a client can act on (400).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kv.params import KVTransferParams, PullSource
from pdserve.prompt_pack import TokenArray, to_list


def _all_below(token_ids: Sequence[int] | TokenArray, bound: int) -> bool:
    """Whether every id is an integer in [0, bound): packed as uint64 (refuses a negative id, one of 2**64 or more,
    anything not an int) and compared at once, ~0.2 ms for 16k ids where a Python loop took ~0.7 ms, once on the
    first token's path (the event loop; AsyncEngine's engine thread does not check again). The router's packed ids
    are an int64 array already (prompt_pack.py): its min and max, a few microseconds."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.size == 0 or (int(token_ids.min()) >= 0 and int(token_ids.max()) < bound)
    try:
        packed = array.array("Q", token_ids)
    except (OverflowError, TypeError):
        return False
    return len(packed) == 0 or int(np.frombuffer(packed, dtype=np.uint64).max()) < bound


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can serve, learned when it started (its model and KV cache)."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_model_len: int  # tokens of prompt (and output) one request may hold
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the cache: a prompt needing more can never be scheduled

    def check(self, prompt_token_ids: Sequence[int] | TokenArray, kv: KVTransferParams | None = None) -> None:
        """Raise ValueError with a user-facing message for input the engine cannot serve."""
        if isinstance(kv, PullSource) and kv.first_token_id is not None and kv.first_token_id >= self.vocab_size:
            raise ValueError(f"kv_transfer_params.first_token_id is outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, longer than max_model_len {self.max_model_len}")
        if not _all_below(prompt_token_ids, self.vocab_size):
            bad = next(t for t in to_list(prompt_token_ids) if not (isinstance(t, int) and 0 <= t < self.vocab_size))
            if not isinstance(bad, int):
                raise ValueError(f"token id {bad!r} is not an integer")
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if -(-n // self.block_size) > self.num_blocks:
            raise ValueError(f"prompt of {n} tokens needs more KV blocks than the cache has ({self.num_blocks})")
