"""D: KV that landed from a prefill instance, and the first output token that came with it (engine thread).

A request whose prefill hands its first output token over (Request.first_token_from_prefill, decided from its
params when its blocks were allocated: kv.params.hands_first_token) received the KV of its whole prompt; the
token is appended as a sampled token is (Scheduler.on_kv_received) and the engine postprocesses and emits it
before its next forward pass, so the client has it as soon as the KV is there. Such a request never computes a
prompt token: its first step computes the first output token's KV and samples the second.

Why D takes P's token rather than computing the last prompt position again: P sampled it from the logits of the
whole prompt's prefill, exactly as a colocated instance does (greedy: the same argmax; a seeded request draws
from a generator seeded by (seed, output step), step 0 on P as in colocated, so D's draws continue the same
sequence; an unseeded one draws once either way). logprobs and n > 1 are refused at the edge, so nothing else
of the first token is needed from P.

When the KV landed without the token: a push recv that timed out and landed only by P's answer to its cancel
(PushCancelAck(landed) carries no token; the PushDone that did was lost or overtaken). The KV of the whole prompt
is there, so D computes its last prompt position itself, as for a prefill that hands no token over (its KV row
is written again, from the same keys); only a windowed group that lacks a key that position reads (its table was
cut at the window of position n, one token later) leaves D nothing to compute from: that recv fails (failed or
recomputed by policy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.groups import STALE, KVGroups
from pdserve.transfer.base import TransferResults

log = logging.getLogger(__name__)


def take_landed(scheduler: Scheduler, res: TransferResults, vocab_size: int) -> list[Request]:
    """Apply res.finished_recvs: each request's KV landed and it may run. Returns the requests that took their
    first output token from the prefill (appended; finish_reason set when it stops them), in order. A request
    that should have had one and had none computes its last prompt position instead where its KV allows
    (can_compute_last_prompt_token); otherwise, or with a token outside the vocabulary, it is moved to
    res.failed_recvs: its KV is not used (failed or recomputed by policy)."""
    took = []
    for rid in res.finished_recvs:
        req = scheduler.waiting_for_kv.get(rid)
        landed_from = res.landed_from.get(rid, ())
        first = res.first_tokens.get(rid) if req is not None and req.first_token_from_prefill else None
        if req is not None and req.first_token_from_prefill:
            if first is not None and not 0 <= first < vocab_size:
                why = f"its first token {first} is outside the vocabulary"
                res.failed_recvs.append((rid, f"the prefill instance handed the KV over but {why}"))
                continue
            if first is None:
                if not can_compute_last_prompt_token(req, landed_from, scheduler.kv_groups, scheduler.block_size):
                    why = "no first token came, and a windowed layer group lacks a key the last prompt position reads"
                    res.failed_recvs.append((rid, f"the prefill instance handed the KV over but {why}"))
                    continue
                log.info("request %s: its KV landed without the prefill's first token; computing the last prompt "
                         "position here", rid)  # fmt: skip
                req.first_token_from_prefill = False
        landed = scheduler.on_kv_received(rid, landed_from, first)
        if landed is not None:
            took.append(landed)
    return took


def can_compute_last_prompt_token(
    req: Request, landed_from: Sequence[int], kv_groups: KVGroups, block_size: int
) -> bool:
    """Whether D holds, in every KV group, each key a query at the last prompt position (n - 1) reads: landed
    (from landed_from[g], TransferResults.landed_from; none given: from D's own prefix hits on) or D's own prefix
    hit (tokens [0, req.num_computed_tokens), in a block its table has not cut as STALE). A full-attention group
    always does (the KV landed right after D's hits); a windowed group's table was cut for position n, so the
    block holding key n - window may be missing."""
    last = req.num_prompt_tokens - 1
    hits = req.num_computed_tokens  # D's own prefix hits, where the recv's tokens start
    for g, window in enumerate(kv_groups.windows):
        first_key = 0 if window is None else max(0, last - window + 1)
        landed = landed_from[g] if g < len(landed_from) else hits
        if req.block_tables[g][first_key // block_size] == STALE or hits <= first_key < landed:
            return False  # its block is cut from D's table, or it lies between D's hits and the landed KV
    return True
