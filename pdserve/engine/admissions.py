"""What the scheduler admitted, counted once per request: requests, their prompt tokens, and how many of those
tokens this instance's own prefix cache served (GET /metrics: pdserve_requests_started_total,
pdserve_prompt_tokens_total, pdserve_prefix_cache_hit_tokens_total). Pure Python, no torch.

A request is counted when it first leaves the waiting queue (Request.has_started): scheduled to compute, its hits
those prefix_cache.take_hits gave it just before; or, on D, parked for its remote KV, its hits D's own cached
prefix. KV received from a prefill is not a hit (pdserve_kv_received_bytes_total counts it). A request preempted
and recomputed, or whose remote KV failed and is recomputed here, takes its hits again but is not counted again:
the counters describe each prompt once, as it was first admitted, so hits <= prompt tokens always holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import Request


@dataclass
class AdmissionCounts:
    """Cumulative since the engine started; written by the scheduler (engine thread), read by stats()."""

    num_requests: int = 0  # requests that left the waiting queue here, each once
    num_prompt_tokens: int = 0  # their prompt tokens
    num_prefix_hit_tokens: int = 0  # of those, tokens this instance's prefix cache held when each was admitted

    def start(self, req: Request) -> None:
        """Mark `req` started (it leaves the waiting queue); the first time, count it with its prefix hits."""
        if not req.has_started:
            self.num_requests += 1
            self.num_prompt_tokens += req.num_prompt_tokens
            self.num_prefix_hit_tokens += req.num_cached_tokens
        req.has_started = True
