"""What the engine hands back per step: one RequestOutput per request that changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.kv.params import KVAnswer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # tokens generated since the previous output of this request
    text: str  # detokenized text so far (stop string cut off); filled by the detokenizing layer
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"
    client_error: bool = False  # the error is the request's own (its kv_transfer_params name KV nobody holds)
    released: bool = False  # P, "abort": its consumer gave the KV up (POST /kv_transfer/release), not a failure
    kv_transfer_params: KVAnswer | None = None  # P, finished: where D finds this request's KV (the connector's answer)
    num_cached_tokens: int = 0  # prompt tokens served from the local prefix cache or received remotely
    timeline: dict[str, float] = field(default_factory=dict)  # event name -> time.time()


def take_output(req: Request, text: str, kv_answer: KVAnswer | None) -> RequestOutput:
    """req's output now: every token so far and those since its previous output (which this marks as sent);
    `text` is the visible text so far, `kv_answer` the connector's answer for a finished prefill leg."""
    new = req.output_token_ids[req.output_sent :]
    req.output_sent = len(req.output_token_ids)
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        new_token_ids=new,
        text=text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        error=req.error,
        num_cached_tokens=req.num_cached_tokens,
        kv_transfer_params=kv_answer,
        timeline=req.timeline,
    )
