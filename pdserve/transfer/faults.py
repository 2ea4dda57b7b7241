"""Test-only faults: the one object through which tests delay or force what production never does.

A test builds a Faults and hands it to what it constructs: the connector factory (factory.make_connectors /
make_rank_worker, as pdserve/testing/pair_child.py does), or the engine (AsyncEngine / LLMEngine, which pass
it to the factory on every rank; tests/e2e/serve_with_faults.py hands `pdserve.server.cli.run` such an engine).
It is no config field, no flag and no environment variable. The default, NO_FAULTS, costs one comparison per
fault point.
The fault suite (tests/transfer/test_faults.py) drops, duplicates, delays and so reorders notifications by
message type on receipt, fails NIXL posts (or only prepared ones), delays a pull's READ past a short lease, and
holds chosen READs in flight (so acks wait behind them); the checksum tests flip a received byte (flip_kv_byte).
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


class FaultPoint(enum.Enum):
    """Where a transfer can be held back (transfer thread)."""

    SEND_READY = "send_ready"  # P (push): a finished prefill reaches the rendezvous (forces registration first)
    REGISTER = "register"  # D (push): the registration is sent (forces the prefill first)
    STAGE_IN = "stage_in"  # D: landed KV is copied from the host mirror into the KV cache
    READ = "read"  # D (pull): the READ is posted (a delay past a short lease_s makes a READ race the lease)


@dataclass(frozen=True)
class Faults:
    delay_send_ready_s: float = 0.0  # FaultPoint.SEND_READY
    delay_register_s: float = 0.0  # FaultPoint.REGISTER
    delay_stage_in_s: float = 0.0  # FaultPoint.STAGE_IN
    delay_read_s: float = 0.0  # FaultPoint.READ
    force_staging: bool = False  # a host mirror even for a CPU cache (staging.py), so CPU tests copy
    # notifications received by this instance, by message type name (wire_notifs.py: "PullRelease", "PushDone", ...)
    drop_notifs: tuple[str, ...] = ()  # never delivered
    duplicate_notifs: tuple[str, ...] = ()  # delivered twice
    delay_notifs: tuple[str, ...] = ()  # delivered notif_delay_s late (so later notifications overtake them)
    notif_delay_s: float = 0.0
    fail_posts: bool = False  # every READ/WRITE post fails as a NIXL error would (AgentError)
    # every prepared READ/WRITE's post (NixlAgent.post_prepared) fails as a NIXL error other than the stale-handle
    # refusal (StaleRequest) would: push_write must fail the transfer, not post it again; fresh posts work
    fail_prepared_posts: bool = False
    # D (pull): the READs of these request ids count as in flight until slow_read_s after their post, as a READ
    # queued behind others in one ordered stream (UCX's emulated GET) does; the others' acks wait behind them
    slow_reads: tuple[str, ...] = ()
    slow_read_s: float = 0.0
    # D (--kv-checksum): one byte of every recv's received KV is flipped once it landed, before D verifies it, as
    # a corruption in transit would (thread/kv_verify.py)
    flip_kv_byte: bool = False

    def __post_init__(self) -> None:
        for point in FaultPoint:
            if not self.delay_s(point) >= 0:
                raise ValueError(f"delay_{point.value}_s must be >= 0, got {self.delay_s(point)}")
        for name in ("notif_delay_s", "slow_read_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def delay_s(self, point: FaultPoint) -> float:
        return float(getattr(self, f"delay_{point.value}_s"))

    def defer(
        self, point: FaultPoint, call_at: Callable[[float, Callable[[], Any]], None], fn: Callable[[], Any]
    ) -> None:
        """Run fn now, or through call_at(time.monotonic() + delay, fn) when point is delayed."""
        delay = self.delay_s(point)
        if delay > 0:
            call_at(time.monotonic() + delay, fn)
        else:
            fn()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Faults:
        values = json.loads(text)
        for name in ("drop_notifs", "duplicate_notifs", "delay_notifs", "slow_reads"):  # JSON lists, tuples here
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


NO_FAULTS = Faults()
