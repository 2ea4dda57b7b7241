"""D's HTTP edge: a request refused before the engine has it gives the KV its coordinates name back at once.

A decode leg carries P's coordinates (pull: P's pinned blocks; push: the transfer P will write). Refused here
for any reason (a bad or mismatched capability, an unknown model, a 400, a 503 admission refusal), it would
never reach the transfer layer, and P would hold that KV for its whole lease (30 s) unless a router released it
(`POST /kv_transfer/release`; a client or a vLLM-style proxy sending D's leg itself does not). So D tells P
(`EngineClient.refuse_transfer`: the engine hands the coordinates to its transfer thread, which notifies every
rank of P; thread/give_back.py). Refusals after the engine has the request are the engine's to report
(async_engine.py: refused input; scheduler.py: aborted before its KV was asked for).

With a deployment secret only coordinates whose capability MAC holds are given back, so a client can free only
KV it was given (capability.py, `may_give_back`); without one, the coordinates themselves are the proof, as in
D's own PullRelease. Docs: docs/architecture.md, "Release on refusal".
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from pdserve.kv.decode import decode
from pdserve.kv.params import KVTransferParams, PullSource, PushSource
from pdserve.server.state import ServerState

log = logging.getLogger(__name__)


class EdgeRefusal:
    """One request's coordinates from its parsed body until the engine has it: leaving the `with` by an exception
    before `engine_has_it` is set gives them back to their producer."""

    def __init__(self, state: ServerState, raw_params: Any) -> None:
        self.state = state
        try:
            self._params: KVTransferParams | ValueError | None = decode(raw_params)
        except ValueError as e:  # KVParamsError: malformed, a 400 of its own (kv_params()); nothing to give back
            self._params = e
        params = self._params
        self.source = params if isinstance(params, PullSource | PushSource) else None  # the producer's coordinates
        self.capability_used = False  # set when this request's own capability check passed (and used it up)
        self.engine_has_it = False  # set once the request is handed to the engine (its refusals are the engine's)

    def __enter__(self) -> EdgeRefusal:
        return self

    def kv_params(self) -> KVTransferParams | None:
        """The body's kv_transfer_params, decoded once (here, for both the give-back and the request: ~0.2 ms for a
        16k prompt's block lists on the dev host); raises what decoding raised (KVParamsError: malformed)."""
        if isinstance(self._params, ValueError):
            raise self._params
        return self._params

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not self.engine_has_it:
            self.give_back(f"{type(exc).__name__}: {exc}")

    def give_back(self, why: str) -> None:
        """Decided now, not at arrival: a concurrent request that was admitted with the same capability since
        owns the KV (its transfer ends the pin), so this one may give back only a capability it used itself or
        one nobody has used."""
        source, engine = self.source, self.state.engine
        if source is None or not engine.is_ready:
            return
        if not self.capability_used and not self.state.kv_auth.may_give_back(source):
            return
        what = source.request_id if isinstance(source, PullSource) else source.transfer_id
        log.info("refused a request carrying %s's coordinates (%s); its producer is told to free them", what, why)
        engine.refuse_transfer(source)


def give_back_unparsed(state: ServerState, body: Any) -> None:
    """A body refused before it was parsed (a RequestValidationError): give back the coordinates it carries."""
    if isinstance(body, dict):
        EdgeRefusal(state, body.get("kv_transfer_params")).give_back("the body failed validation")
