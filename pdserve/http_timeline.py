"""When a request passed each step of an HTTP edge (the router's, or an instance's before and after its engine):
the timestamps that split "router -> P" and pull's relay (docs/benchmarks.md, "Light load").

A request's events live in its ASGI scope from the moment the app sees it (`StampReceived`, the outermost
middleware: the request head is parsed, the body not yet read) and are marked on the event loop as it goes
(`mark`); once the request has an id, `EdgeTimelines.add` keeps a reference to them, so later marks (an
instance's answer) land there too. GET /timeline shows them: an instance merges them into its engine's timeline
of the same request, the router serves its own. Event loop only: no lock, nothing shared with another thread.
Times are time.time() (unix seconds), the clock of the engines' timelines.

Instance events, in order: http_received, body_read, body_parsed (JSON), body_validated (the request model),
prompt_ready (token ids, tokenized if text), admitted (checks done, handed to the engine; the engine's own
"arrival" follows), then after the engine's first token on a prefill leg: answer_ready (the final output is on the
event loop), answer_encoded (the JSON answer built). Router events: ROUTER_EVENTS.

Light (starlette only): the router imports it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

EVENTS_KEY = "pdserve_edge_events"  # key in the ASGI scope's state: this request's events so far
MAX_EDGE_TIMELINES = 2000  # requests whose edge events GET /timeline can still show (the engine keeps as many)
ROUTER_EVENTS = (
    "http_received",
    "body_read",
    "body_parsed",
    "body_validated",
    "prefill_sent",  # P's leg encoded, about to be written
    "prefill_answered",  # P's status line and headers arrived
    "prefill_read",  # P's answer read and parsed
    "decode_sent",  # D's leg encoded, about to be written
    "decode_answered",  # D's status line and headers arrived (streamed: with its first token)
)


def events_of(request: Request) -> dict[str, float]:
    """This request's events (the dict itself: marks made later show wherever it is held)."""
    state = request.scope.setdefault("state", {})
    events: dict[str, float] = state.setdefault(EVENTS_KEY, {})
    return events


def mark(request: Request, event: str) -> None:
    """Record the first time `event` happened to this request."""
    events_of(request).setdefault(event, time.time())


class StampReceived:
    """ASGI middleware (add it last: outermost): stamps `http_received` on every HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[EVENTS_KEY] = {"http_received": time.time()}
        await self.app(scope, receive, send)


class EdgeTimelines:
    """The edge events of the last MAX_EDGE_TIMELINES requests by id, oldest dropped first (event loop only)."""

    def __init__(self, role: str) -> None:
        self.role = role  # "router", or the instance's kv role (its /timeline entries say it)
        self._entries: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, request_id: str, client_request_id: str | None, events: dict[str, float]) -> None:
        """Track a request; `events` is its events_of() dict, held, not copied."""
        self._entries[request_id] = {
            "request_id": request_id,
            "client_request_id": client_request_id,
            "role": self.role,
            "events": events,
        }
        while len(self._entries) > MAX_EDGE_TIMELINES:
            self._entries.popitem(last=False)

    def events(self, request_id: str) -> dict[str, float]:
        """A request's edge events ({} when not tracked)."""
        entry = self._entries.get(request_id)
        return {} if entry is None else dict(entry["events"])

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of every tracked request's entry (the /timeline shape)."""
        return [dict(e, events=dict(e["events"])) for e in self._entries.values()]

    def merged(self, engine_entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An engine's /timeline entries with each request's edge events added (the engine's own win a clash)."""
        for entry in engine_entries:
            edge = self.events(entry["request_id"])
            if edge:
                entry["events"] = {**edge, **entry["events"]}
        return engine_entries
