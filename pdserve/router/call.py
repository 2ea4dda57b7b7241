"""One client request as the router handles it (Call), and the body its prefill leg sends (prefill_body).

Lives apart from the orchestrator because the proxy builds Calls and the stream relay reads them; neither
needs the pull/push orchestration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import StrictInt, TypeAdapter, ValidationError
from starlette.requests import Request

from pdserve import prompt_pack
from pdserve.http_timeline import events_of
from pdserve.openai_request import CompletionRequest, SamplingFields
from pdserve.router.policy import Backend
from pdserve.web import REQUEST_ID_HEADER

# P's answered ids, checked in one pass of pydantic's core (~0.2 ms for 16k ids, where a Python loop over each
# id's type took ~0.5-0.7 ms on the first token's path): ints only (no bool, float or str), any size
_ANSWERED_IDS = TypeAdapter(list[StrictInt])


@dataclass
class Call:
    """One client request as the router handles it."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's JSON body, untouched (validated by openai_request.parse_request)
    request_id: str  # sent to both legs as X-Request-Id
    http: Request  # the client's request, watched for a disconnect
    is_stream: bool  # the body's `stream`, as the instances read it (parsed, so `"false"` never counts as true)
    max_tokens: int | None = None  # the output length asked for (max_completion_tokens or max_tokens), parsed
    prefill_url: str | None = None  # chosen instances, for the log line
    decode_url: str | None = None  # the decode instance; in colocated mode the instance that ran it whole
    is_whole: bool = False  # sent to one instance without a prefill leg (colocated, or a short prompt)
    parsed: SamplingFields | None = None  # the body as openai_request.parse_request validated it
    headers: dict[str, str] = field(init=False)
    _packed: str | None = field(init=False, default=None)  # the prompt's ids packed, once a leg needed them
    _packed_done: bool = field(init=False, default=False)  # _packed was computed (it may be None)

    def __post_init__(self) -> None:
        self.headers = {REQUEST_ID_HEADER: self.request_id}

    def packed_prompt(self) -> str | None:
        """The client's token-id prompt packed (prompt_pack.FIELD's value), computed once for all legs; None for
        text, a chat, or an id that cannot be packed (the leg then carries the JSON list)."""
        if not self._packed_done:
            prompt = self.parsed.prompt if isinstance(self.parsed, CompletionRequest) else None
            if isinstance(prompt, np.ndarray):  # the client sent them packed: its value, validated by parse_request
                self._packed = self.body[prompt_pack.FIELD]
            else:
                self._packed = prompt_pack.pack(prompt) if isinstance(prompt, list) else None
            self._packed_done = True
        return self._packed

    def unpacked_prompt(self) -> list[int] | None:
        """The ids of a client that sent them packed (prompt_pack.FIELD), as the JSON list a leg to an instance
        that does not read the packed form carries; None for any other prompt (its body goes as it came)."""
        prompt = self.parsed.prompt if isinstance(self.parsed, CompletionRequest) else None
        return prompt_pack.to_list(prompt) if isinstance(prompt, np.ndarray) else None

    @property
    def events(self) -> dict[str, float]:
        """This call's edge timeline (http_timeline.py: the router's GET /timeline shows it)."""
        return events_of(self.http)


def relays_prompt_ids(call: Call) -> bool:
    """Whether a pull call's decode leg gets P's token ids instead of the client's text: a completion of a text
    prompt (D then tokenizes nothing; the capability's prompt digest binds the ids to P's KV). A chat's template
    renders on D as before."""
    return isinstance(call.parsed, CompletionRequest) and isinstance(call.parsed.prompt, str)


def reads_packed(backend: Backend) -> bool:
    """Whether `backend` said (GET /health) that it reads the packed prompt this router writes."""
    return backend.packed_ids == prompt_pack.VERSION


def leg_body(call: Call, body: dict[str, Any], packed: bool, ids: list[int] | None = None) -> dict[str, Any]:
    """`body` for one leg: with `prompt` as `ids` (P's token ids of a text prompt) when given, packed
    (prompt_pack.py) when `packed` (the instance reads it: reads_packed) and the ids can be, else as JSON (a
    client's packed ids too: Call.unpacked_prompt)."""
    if ids is not None:
        value = prompt_pack.pack(ids) if packed else None
    else:
        value = call.packed_prompt() if packed else None
        if value is None:
            ids = call.unpacked_prompt()
            if ids is None:
                return body
    out = {k: v for k, v in body.items() if k not in ("prompt", prompt_pack.FIELD)}
    if value is None:
        out["prompt"] = ids
    else:
        out[prompt_pack.FIELD] = value
    return out


def answered_prompt_ids(answer: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids in P's answer (`return_token_ids`), or None when it has none (a vLLM P, say)."""
    choices = answer.get("choices")
    ids = (
        choices[0].get("prompt_token_ids")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict)
        else None
    )
    if not isinstance(ids, list) or not ids:
        return None
    try:
        return _ANSWERED_IDS.validate_python(ids)
    except ValidationError:
        return None


def prefill_body(
    body: dict[str, Any], kv_transfer_params: dict[str, Any], want_prompt_ids: bool = False
) -> dict[str, Any]:
    """The P leg: the client's body cut to one output token, not streamed, with P's transfer params; its answer
    carries the prompt's token ids only when `want_prompt_ids` (relays_prompt_ids): otherwise nobody reads them."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("return_token_ids", None)  # 16k ids nobody reads cost ~5 ms in P's answer and the router (dev host)
    if want_prompt_ids:
        out["return_token_ids"] = True
    out["kv_transfer_params"] = kv_transfer_params
    return out
