"""One request's state inside the engine (pure Python: the scheduler and block pool never import torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.kv.params import KVTransferParams
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; no blocks, or blocks but not yet admitted to the running batch
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # D: blocks allocated, KV arriving from a prefill instance
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    kv_transfer_params: KVTransferParams | None = None  # parsed at the HTTP edge; the one copy on this instance
    arrival_time: float = field(default_factory=time.time)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # one table per KV group (kv/groups.py; one for most models): entry i holds tokens
    # [i*block_size, (i+1)*block_size) of that group's layers; a windowed group's entries before its window are
    # kv.groups.STALE (freed). The scheduler sizes the list to the number of groups.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache or a remote prefill
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    # D: per KV group, the first token whose KV the blocks hold from a remote prefill ([]: every row from 0 is
    # valid). A windowed group's first block may hold unreceived rows before it (the prefill's blocks were
    # smaller); attention never reads them, but such a block is never registered in the prefix cache
    kv_valid_from: list[int] = field(default_factory=list)
    # D: False when its prompt's KV came from a remote prefill with no proof that it is this prompt's (no
    # deployment secret): none of its blocks past its own prefix hit may serve another request
    cache_blocks: bool = True
    block_hashes: list[bytes] = field(default_factory=list)  # chained digest of each full block, computed lazily
    needs_remote_kv: bool = False  # D: prompt KV comes from a remote prefill
    remote_kv_ready: bool = False  # D: that KV has landed; compute only the last prompt token (or, with the
    # prefill's first token, none: the first output token was appended when the KV landed)
    # D: the prefill hands this request's first output token over with the KV of its whole prompt
    # (kv.params.hands_first_token), decided when its blocks are allocated
    first_token_from_prefill: bool = False
    pin_released: bool = False  # P: finished and pinned, and the engine gave the pin up (abort, release)
    # left the waiting queue once (scheduled to compute, or D parked for remote KV): from then on it is no longer
    # queued, and --max-queue-wait-s does not apply (it runs to its end or its own deadline)
    has_started: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    timeline: dict[str, float] = field(default_factory=dict)  # event -> time.time()
    output_sent: int = 0  # tokens already handed out in RequestOutputs

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (the whole table of a one-group model; what transfers and P/D address)."""
        return self.block_tables[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list (O(end - start))."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def append_output(self, token_id: int, max_model_len: int) -> bool:
        """Append one output token (sampled here, or D's first from its prefill instance); True when it meets a stop
        condition, finish_reason then set: "stop" for EOS (unless ignore_eos) or a stop token id, "length" for
        max_tokens or max_model_len. Stop strings are the detokenizer's (engine.py)."""
        self.output_token_ids.append(token_id)
        p = self.params
        if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def mark(self, event: str) -> None:
        """Record the first time an event happened (for the timeline)."""
        self.timeline.setdefault(event, time.time())
