"""One client request as the router handles it (Call), and the body its prefill leg sends (prefill_body).

Lives apart from the orchestrator because the proxy builds Calls and the stream relay reads them; neither
needs the pull/push orchestration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pdserve.http_timeline import events_of
from pdserve.openai_request import SamplingFields
from pdserve.web import REQUEST_ID_HEADER


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

    def __post_init__(self) -> None:
        self.headers = {REQUEST_ID_HEADER: self.request_id}

    @property
    def events(self) -> dict[str, float]:
        """This call's edge timeline (http_timeline.py: the router's GET /timeline shows it)."""
        return events_of(self.http)


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The P leg: the client's body cut to one output token, not streamed, with P's transfer params."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = kv_transfer_params
    return out
