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
"""

from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.transfer.base import TransferResults


def take_landed(scheduler: Scheduler, res: TransferResults, vocab_size: int) -> list[Request]:
    """Apply res.finished_recvs: each request's KV landed and it may run. Returns the requests that took their
    first output token from the prefill (appended; finish_reason set when it stops them), in order. A request
    that should have had one and did not (a push recv that landed only by a cancel's answer, a peer that sent
    none) or had one outside the vocabulary is moved to res.failed_recvs instead: its KV is not used (failed or
    recomputed by policy), since a windowed group's KV may lack a row D would need to compute the last prompt
    token itself."""
    took = []
    for rid in res.finished_recvs:
        req = scheduler.waiting_for_kv.get(rid)
        first = res.first_tokens.get(rid) if req is not None and req.first_token_from_prefill else None
        if req is not None and req.first_token_from_prefill and (first is None or not 0 <= first < vocab_size):
            why = "no first token came" if first is None else f"its first token {first} is outside the vocabulary"
            res.failed_recvs.append((rid, f"the prefill instance handed the KV over but {why}"))
            continue
        landed = scheduler.on_kv_received(rid, res.landed_from.get(rid, ()), first)
        if landed is not None:
            took.append(landed)
    return took
