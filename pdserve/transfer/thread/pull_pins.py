"""Pull mode, P's half on the transfer thread: a finished request's blocks stay pinned under a lease until
every rank of its consumer (D) released them; each release is answered with PullReleaseAck saying whether the
pin held throughout (docs/architecture.md, "Pull"). D's half (the READs) is pull.py.

A release names the blocks it read: only a pin of exactly those blocks is freed (a stale or forged release
cannot free another request's). A release that arrives before its SendTask (the engine holds the blocks
until then) waits in `early`, for EARLY_GRACE_S at most: a release for a request this rank never pinned (a
forged or made-up id) is answered held=False, refused, then, so D refuses its client at once (400) instead of
waiting out its own confirmation timeout; should that request's pin come after all, it is freed at once (its
consumer was told there was none). One that arrives after the pin ended without it is answered held=False from
`gone`: refused when every consumer rank had released it already (a replay), not when the lease ran out or the
engine released it (the instance's failure, not the request's).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.transfer.base import SendTask
from pdserve.transfer.thread.agent import AgentError
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.kv_verify import release_sums
from pdserve.transfer.thread.results import SendOutcome
from pdserve.transfer.wire import encode
from pdserve.transfer.wire_notifs import PullRelease, PullReleaseAck

log = logging.getLogger(__name__)

MAX_EARLY_RELEASES = 4096  # releases that arrived before their SendTask (kept briefly)
MAX_GONE_PINS = 16384  # request ids whose pins ended without a release (expired, released), for late releases
# a release before its SendTask waits this long for it (the SendTask leaves P's engine before P's answer does, so
# a genuine one is here within a transfer-thread turn); well under D's confirmation timeout (peer_timeout_s)
EARLY_GRACE_S = 1.0
NEVER_PINNED = "no pin of this request here (never issued by this instance, or released long ago)"


@dataclass
class _Pin:
    """P: one request's blocks on this rank, pinned until every rank of the consumer released them."""

    send: SendTask
    released_by: set[str] = field(default_factory=set)  # D ranks' agents whose release held
    ok: bool = True  # every release so far said ok
    num_bytes: int = 0  # bytes the consumer ranks read from this rank


@dataclass(eq=False)
class _Early:
    """Releases of one request that came before its pin, and the grace timer that answers them (by identity)."""

    releases: list[tuple[str, PullRelease]] = field(default_factory=list)


class PinKeeper:
    """P: the pinned requests of this rank, their leases, and the answers to D's releases."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.pinned: dict[str, _Pin] = {}  # request id -> blocks pinned until every D rank's release or lease
        self.early: OrderedDict[str, _Early] = OrderedDict()  # releases before the pin
        # request id -> (why its pin ended or never was, whether a release for it is the request's error)
        self.gone: OrderedDict[str, tuple[str, bool]] = OrderedDict()

    def pin(self, send: SendTask, now: float) -> None:
        rid = send.request_id
        if rid in self.pinned:  # never: P's request ids are its own; a second pin would leak the first's blocks
            log.error("pull: request %s is pinned already; the new send is freed at once", rid)
            self.ctx.sink.send_finished(rid, SendOutcome.FAILED)
            return
        if self.gone.get(rid, ("", False))[0] == NEVER_PINNED:  # its consumer was told so: nobody will release it
            log.warning("pull: request %s was pinned more than %g s after its release; freed at once", rid,
                        EARLY_GRACE_S)  # fmt: skip
            self.ctx.sink.send_finished(rid, SendOutcome.FAILED)
            return
        self.gone.pop(rid, None)
        self.pinned[rid] = _Pin(send)
        self.ctx.thread.call_at(now + self.ctx.cfg.lease_s, lambda: self._expire(rid, send))
        early = self.early.pop(rid, None)
        for release in early.releases if early is not None else []:  # the engine held the blocks meanwhile
            self.on_release(*release)

    def on_release(self, sender: str, msg: PullRelease) -> None:
        """A D rank is done with (or gave up on) a pin. Only a pin of exactly the release's blocks is freed, once
        every rank of the consumer released it (each D rank releases every P rank, READ from it or not)."""
        rid = msg.request_id
        pin = self.pinned.get(rid)
        if pin is None:
            if (gone := self.gone.get(rid)) is not None:
                self._ack(sender, msg, False, gone[0], refused=gone[1])
            else:  # before its SendTask (the engine holds the blocks until then), or unknown: answered at the pin
                if (early := self.early.get(rid)) is None:
                    early = self.early[rid] = _Early()
                    self.ctx.thread.call_at(time.monotonic() + EARLY_GRACE_S, lambda: self._never_pinned(rid, early))
                early.releases.append((sender, msg))
                while len(self.early) > MAX_EARLY_RELEASES:
                    self.early.popitem(last=False)
            return
        send = pin.send
        if list(send.pin_ids) != msg.block_ids:
            log.warning("pull: release of %s names blocks %s, the pin holds %s; pin kept", rid, msg.block_ids,
                        list(send.pin_ids))  # fmt: skip
            self._ack(sender, msg, False, "the release names other blocks than the pin holds")
            return
        consumer = self.ctx.peers.by_agent(sender)
        num_consumers = consumer.info.tp_size if consumer is not None else 1
        pin.released_by.add(sender)
        pin.ok, pin.num_bytes = pin.ok and msg.ok, pin.num_bytes + msg.num_bytes
        d_rank = consumer.info.tp_rank if consumer is not None else 0
        self.ctx.sink.event(rid, f"pull_release.p{self.ctx.spec.tp_rank}.r{d_rank}")  # one per (P rank, D rank)
        self._ack(sender, msg, True, "", release_sums(self.ctx, send, msg) if msg.ok else [])  # (still pinned)
        if len(pin.released_by) >= num_consumers:
            del self.pinned[rid]
            self._gone(rid, "every rank of the consumer released it already", refused=True)  # a replay: refused
            self.ctx.sink.send_finished(rid, SendOutcome.OK if pin.ok else SendOutcome.FAILED, pin.num_bytes)

    def _never_pinned(self, rid: str, early: _Early) -> None:
        """EARLY_GRACE_S after the first release for a request with no pin: if it is still not pinned, say so."""
        if self.early.get(rid) is not early:
            return  # pinned meanwhile, or dropped from `early`
        del self.early[rid]
        self._gone(rid, NEVER_PINNED, refused=True)
        for sender, msg in early.releases:
            self._ack(sender, msg, False, NEVER_PINNED, refused=True)

    def _ack(
        self,
        sender: str,
        msg: PullRelease,
        held: bool,
        reason: str,
        checksum: list[int] | None = None,
        refused: bool = False,
    ) -> None:
        if not msg.ok:
            return  # D gave up: it waits for no answer
        if self.ctx.peers.by_agent(sender) is None:
            log.warning("pull: release of %s from unknown agent %s; not answered", msg.request_id, sender)
            return
        try:
            ack = PullReleaseAck(msg.request_id, held, reason, checksum or [], refused)
            self.ctx.agent.send_notif(sender, encode(ack))
        except AgentError as e:  # D fails the recv after peer_timeout_s
            log.warning("pull: could not answer the release of %s: %s", msg.request_id, e)

    def _expire(self, rid: str, send: SendTask) -> None:
        pin = self.pinned.get(rid)
        if pin is not None and pin.send is send:
            log.info("pull: lease of %s expired after %g s; freeing its blocks", rid, self.ctx.cfg.lease_s)
            self.unpin(rid, f"the lease of {self.ctx.cfg.lease_s:g} s expired", SendOutcome.EXPIRED)

    def unpin(self, rid: str, why: str, outcome: SendOutcome = SendOutcome.FAILED) -> None:
        """End a pin without D's release: a release that comes later is answered held=False."""
        self.early.pop(rid, None)
        if self.pinned.pop(rid, None) is None:
            return
        self._gone(rid, why)
        self.ctx.sink.send_finished(rid, outcome)

    def _gone(self, rid: str, why: str, refused: bool = False) -> None:
        self.gone[rid] = (why, refused)
        while len(self.gone) > MAX_GONE_PINS:
            self.gone.popitem(last=False)
