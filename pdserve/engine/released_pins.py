"""P: the requests whose pinned KV the engine gave up (abort, or D's leg failed), remembered a while.

Lives apart from the engine because it is bookkeeping with its own bound: a router may repeat a release (it
retries, or D's leg fails after an abort), and the repeat must still answer "found" after the request and its
pin are gone from the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pdserve.engine.request import Request
from pdserve.kv.params import RemoteDecode

MAX_RELEASED_IDS = 4096  # P: request ids whose pins were released, so a repeated release still answers found


class ReleasedPins:
    """Request id -> its transfer id (push; None for pull) of the last MAX_RELEASED_IDS released pins."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, str | None] = OrderedDict()

    def remember(self, req: Request) -> None:
        params = req.kv_transfer_params
        self._ids[req.request_id] = params.transfer_id if isinstance(params, RemoteDecode) else None
        while len(self._ids) > MAX_RELEASED_IDS:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def producer_of(self, transfer_id: str | None, live: Iterable[Request]) -> str | None:
        """The request id of the prefill leg (RemoteDecode params) a push transfer belongs to: among `live`
        (the scheduler's pinned and running requests) first, then among the released ones; None if unknown."""
        for req in live:
            params = req.kv_transfer_params
            if isinstance(params, RemoteDecode) and params.transfer_id == transfer_id:
                return req.request_id
        return next((rid for rid, tid in self._ids.items() if tid == transfer_id), None)
