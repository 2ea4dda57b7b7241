"""Release on refusal, the parts without processes: which refused requests' coordinates D gives back to their
producer (the capability rule, the edge guard, the scheduler's abort of a request still queued). The
notifications themselves and P freeing its blocks run end to end in tests/e2e/test_release_on_refusal.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.auth import new_secret
from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.capability import KVAuth
from pdserve.kv.params import Capability, PullSource, PushSource, encode
from pdserve.sampling_params import SamplingParams
from pdserve.server.protocol import ApiError
from pdserve.server.refusal import EdgeRefusal, give_back_unparsed
from pdserve.transfer.nop import NopScheduler

TOKENS = list(range(40, 60))
SRC = PullSource("127.0.0.1", 5600, "p", "req-1", (3, 4), len(TOKENS) - 1, 16)


class Engine:
    """What EdgeRefusal needs of the engine client: readiness and refuse_transfer."""

    def __init__(self) -> None:
        self.is_ready = True
        self.refused: list[PullSource | PushSource] = []

    def refuse_transfer(self, source: PullSource | PushSource) -> None:
        self.refused.append(source)


def state(auth: KVAuth) -> Any:
    return SimpleNamespace(engine=Engine(), kv_auth=auth)


def signed_pull(auth: KVAuth) -> PullSource:
    return auth.issue_pull(SRC, TOKENS, 30.0)


def test_may_give_back_only_what_a_valid_capability_names() -> None:
    secret = new_secret().encode()
    auth = KVAuth(secret)
    pull = signed_pull(auth)
    assert auth.may_give_back(pull)
    cap = auth.issue_push("t-1", "p", "127.0.0.1", 5600, 30.0)
    push = PushSource("t-1", "127.0.0.1", 5600, "p", 1, cap)
    assert auth.may_give_back(push)
    assert not auth.may_give_back(dataclasses.replace(pull, capability=None))  # unsigned
    assert pull.capability is not None
    forged = dataclasses.replace(pull.capability, mac="0" * 64)
    assert not auth.may_give_back(dataclasses.replace(pull, capability=forged))
    assert not auth.may_give_back(dataclasses.replace(pull, block_ids=(5, 6)))  # altered: other blocks
    assert not auth.may_give_back(dataclasses.replace(push, transfer_id="t-2"))  # altered: another transfer
    other_secret = KVAuth(new_secret().encode())
    assert not other_secret.may_give_back(pull)
    # expired, or (pull) for another prompt: still the caller's to give back
    past_expiry = pull.capability.expires_at + 1
    assert KVAuth(secret, clock=lambda: past_expiry).may_give_back(pull)
    # replayed: this instance admitted it once; that request's own transfer ends the pin
    auth.check(pull, TOKENS, {})
    assert not auth.may_give_back(pull)
    assert KVAuth(None).may_give_back(SRC)  # no secret: the coordinates are the proof


def test_edge_refusal_gives_back_until_the_engine_has_the_request() -> None:
    auth = KVAuth(new_secret().encode())
    pull = signed_pull(auth)
    st = state(auth)
    with pytest.raises(ApiError), EdgeRefusal(st, encode(pull)):
        raise ApiError(503, "busy")
    assert st.engine.refused == [pull]
    with pytest.raises(ApiError), EdgeRefusal(st, encode(pull)) as edge:
        edge.engine_has_it = True  # from here the engine reports
        raise ApiError(503, "no first token in time")
    with EdgeRefusal(st, encode(pull)):
        pass  # not refused
    assert pull.capability is not None
    forged = dataclasses.replace(pull, capability=Capability(pull.capability.expires_at, "0" * 64, None))
    with pytest.raises(ApiError), EdgeRefusal(st, encode(forged)):
        raise ApiError(400, "bad max_tokens")
    with pytest.raises(ApiError), EdgeRefusal(st, {"remote_port": "not a port", "do_remote_prefill": True}):
        raise ApiError(400, "bad params")
    with pytest.raises(ApiError), EdgeRefusal(st, {"do_remote_decode": True}):  # a P leg names no producer
        raise ApiError(400, "bad")
    st.engine.is_ready = False
    with pytest.raises(ApiError), EdgeRefusal(st, encode(pull)):
        raise ApiError(503, "loading")
    assert st.engine.refused == [pull]


def test_edge_refusal_decides_at_its_refusal_who_owns_the_capability() -> None:
    """A request whose own capability check passed (and used it up) and that is refused after it (the 503
    admission) gives back. A second request with the same capability that arrived before the first one's check
    and is refused after it (as a replay, or anything else) gives nothing back: the admitted one owns the KV."""
    auth = KVAuth(new_secret().encode())
    pull = signed_pull(auth)
    st = state(auth)
    with pytest.raises(ApiError), EdgeRefusal(st, encode(pull)) as edge:
        auth.check(pull, TOKENS, {})
        edge.capability_used = True
        raise ApiError(503, "busy")
    assert st.engine.refused == [pull]
    st.engine.refused.clear()
    again = auth.issue_pull(dataclasses.replace(SRC, request_id="req-2"), TOKENS, 30.0)  # two requests race
    late = EdgeRefusal(st, encode(again))  # arrives first, checked second
    with EdgeRefusal(st, encode(again)) as first:
        auth.check(again, TOKENS, {})
        first.capability_used = True
        first.engine_has_it = True  # admitted: its transfer ends the pin
    with pytest.raises(ApiError), late:
        raise ApiError(403, "kv_capability was already used (replayed)")
    assert st.engine.refused == []


def test_a_body_that_failed_validation_gives_back_too() -> None:
    auth = KVAuth(None)
    st = state(auth)
    give_back_unparsed(st, {"prompt": "x", "temperature": "hot", "kv_transfer_params": encode(SRC)})
    give_back_unparsed(st, b"not json")
    give_back_unparsed(st, {"prompt": "x"})
    assert st.engine.refused == [SRC]


class Recording(NopScheduler):
    def __init__(self) -> None:
        super().__init__(4)
        self.refused: list[PullSource | PushSource] = []

    def needs_remote_kv(self, request_id: str, params: Any) -> bool:
        return isinstance(params, PullSource | PushSource)

    def on_blocks_allocated(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_recv_aborted(self, request_id: str) -> None:
        pass

    def on_refused(self, source: PullSource | PushSource) -> None:
        self.refused.append(source)


def test_scheduler_gives_back_a_request_aborted_before_its_kv_was_asked_for() -> None:
    """D: aborted while still queued (never parked: no blocks, no RecvTask) -> its producer is told; aborted while
    parked -> the recv's cancel tells it instead (not a refusal)."""
    conn = Recording()
    s = Scheduler(SchedulerConfig(8, 64), BlockPool(2, True), 4, 1024, conn)  # 2 blocks: the second request waits
    source = PullSource("127.0.0.1", 5600, None, "p-1", (0, 1), 7, 4)
    parked = Request("parked", list(range(8)), SamplingParams.greedy(4), (), source)
    queued = Request("queued", list(range(8)), SamplingParams.greedy(4), (), source)
    s.add(parked)
    s.add(queued)
    s.schedule()
    assert "parked" in s.waiting_for_kv and "queued" not in s.waiting_for_kv
    s.abort("queued")
    assert conn.refused == [source]
    s.abort("parked")
    assert conn.refused == [source]
