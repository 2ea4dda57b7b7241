"""The fixed limits a request is checked against before it is queued (any thread: nothing here changes).

The server's event loop checks a request here before handing it to the engine thread (async_engine.py), and
the engine checks it again as it adds it; each refusal is a ValueError whose message a client can act on (400).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv.params import KVTransferParams, PullSource


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can serve, learned when it started (its model and KV cache)."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_model_len: int  # tokens of prompt (and output) one request may hold
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the cache: a prompt needing more can never be scheduled

    def check(self, prompt_token_ids: list[int], kv: KVTransferParams | None = None) -> None:
        """Raise ValueError with a user-facing message for input the engine cannot serve."""
        if isinstance(kv, PullSource) and kv.first_token_id is not None and kv.first_token_id >= self.vocab_size:
            raise ValueError(f"kv_transfer_params.first_token_id is outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, longer than max_model_len {self.max_model_len}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if -(-n // self.block_size) > self.num_blocks:
            raise ValueError(f"prompt of {n} tokens needs more KV blocks than the cache has ({self.num_blocks})")
