"""Recent requests' timelines: when each request arrived, was scheduled, got its KV, its first token, finished.

Lives apart from the engine because it is the one structure another thread reads (GET /timeline, through
AsyncEngine.timelines) while the engine thread writes it: the bound, the copy and its retry are in one place.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_TIMELINES = 2000  # finished requests whose timestamps GET /timeline can still show


class Timelines:
    """Timelines of the last MAX_TIMELINES requests by id, oldest dropped first; written by the engine thread."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, request_id: str, client_request_id: str | None, role: str, events: dict[str, float]) -> None:
        """Track a new request; `events` is its Request.timeline (event -> time.time()), shared, not copied."""
        self._entries[request_id] = {
            "request_id": request_id,
            "client_request_id": client_request_id,
            "role": role,
            "events": events,
        }
        while len(self._entries) > MAX_TIMELINES:
            self._entries.popitem(last=False)

    def record(self, request_id: str, event: str, t: float) -> None:
        """Record the first time `event` happened to a tracked request (the connector's events); else nothing."""
        if (entry := self._entries.get(request_id)) is not None:
            entry["events"].setdefault(event, t)

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of every timeline; safe to call from another thread (retries if the engine mutated them)."""
        for _ in range(10):
            try:
                return [dict(t, events=dict(t["events"])) for t in list(self._entries.values())]
            except RuntimeError:  # changed size during iteration
                continue
        return []
