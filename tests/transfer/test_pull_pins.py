"""P's pins in pull mode (transfer/thread/pull_pins.py), the answers to D's releases without processes: the
transfer thread's timers and the NIXL notifications are recorded by a small stand-in context, so the grace
period for a release that comes before its pin can be played out exactly. The same answers through real agents
and servers: tests/transfer/test_pull.py, tests/e2e/test_secure_by_default.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from pdserve.transfer.base import SendTask
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.pull_pins import EARLY_GRACE_S, NEVER_PINNED, PinKeeper
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire import decode
from pdserve.transfer.wire_notifs import PullRelease, PullReleaseAck

D = "d-agent"


class Context:
    """What PinKeeper uses of the transfer context: timers (run by hand), notifications, results, one D peer."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[[], Any]]] = []
        self.acks: list[PullReleaseAck] = []
        self.finished: list[tuple[str, SendOutcome]] = []
        self.thread = SimpleNamespace(call_at=lambda when, fn: self.timers.append((when, fn)))
        self.agent = SimpleNamespace(send_notif=lambda agent, data: self.acks.append(decode(data)))
        self.sink = SimpleNamespace(
            send_finished=lambda rid, outcome, num_bytes=0: self.finished.append((rid, outcome)),
            event=lambda *args: None,
        )
        d_peer = SimpleNamespace(info=SimpleNamespace(tp_size=1, tp_rank=0))
        self.peers = SimpleNamespace(by_agent=lambda agent: d_peer if agent == D else None)
        self.cfg = SimpleNamespace(lease_s=30.0)
        self.spec = SimpleNamespace(tp_rank=0)
        self.checksum = None

    def fire_timers(self, before: float) -> None:
        """Run the timers due before `before` (the grace timers: the leases are 30 s away)."""
        due = [fn for when, fn in self.timers if when < before]
        self.timers = [(w, fn) for w, fn in self.timers if w >= before]
        for fn in due:
            fn()


def release(rid: str, blocks: list[int]) -> PullRelease:
    return PullRelease(rid, True, 64, blocks)


def keeper() -> tuple[PinKeeper, Context]:
    ctx = Context()
    return PinKeeper(cast(TransferContext, ctx)), ctx


def test_made_up_and_replayed_releases_are_refused_an_expired_lease_is_not() -> None:
    pins, ctx = keeper()
    pins.on_release(D, release("made-up", [1, 2]))
    assert ctx.acks == []  # within the grace: its pin may still come
    ctx.fire_timers(time.monotonic() + EARLY_GRACE_S + 1)
    assert [(a.held, a.refused, a.reason) for a in ctx.acks] == [(False, True, NEVER_PINNED)]
    pins.pin(SendTask("r", (3, 4), 20), time.monotonic())
    pins.on_release(D, release("r", [3, 4]))
    assert ctx.acks[-1].held and ctx.finished == [("r", SendOutcome.OK)]
    pins.on_release(D, release("r", [3, 4]))  # a replay
    assert (ctx.acks[-1].held, ctx.acks[-1].refused) == (False, True)
    pins.pin(SendTask("slow-d", (5,), 10), time.monotonic())
    pins.unpin("slow-d", "the lease of 30 s expired")
    pins.on_release(D, release("slow-d", [5]))  # the instance's failure, not the request's
    assert (ctx.acks[-1].held, ctx.acks[-1].refused) == (False, False)


def test_a_pin_after_its_grace_ran_out_is_freed_at_once_and_an_early_one_is_served() -> None:
    pins, ctx = keeper()
    pins.on_release(D, release("early", [7]))
    pins.pin(SendTask("early", (7,), 10), time.monotonic())  # within the grace: the release is served
    assert ctx.acks[-1].held and ctx.finished == [("early", SendOutcome.OK)]
    ctx.fire_timers(time.monotonic() + EARLY_GRACE_S + 1)  # that grace timer no longer answers anything
    assert len(ctx.acks) == 1
    pins.on_release(D, release("late", [8]))
    ctx.fire_timers(time.monotonic() + EARLY_GRACE_S + 1)
    assert ctx.acks[-1].refused
    pins.pin(SendTask("late", (8,), 10), time.monotonic())  # its consumer gave up: nobody would release it
    assert ctx.finished[-1] == ("late", SendOutcome.FAILED) and "late" not in pins.pinned
