"""Thread-safe hand-back from the transfer thread to the engine: results, timeline events, counters."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from pdserve.transfer.base import TransferResults, TransferStats


class SendOutcome(enum.Enum):
    """How P's hand-over of a request's blocks ended (each counts in a different /metrics series)."""

    OK = "ok"  # consumed by D
    FAILED = "failed"
    EXPIRED = "expired"  # nobody consumed it within lease_s


class ResultSink:
    """Written by the transfer thread, drained by the engine thread (poll_results) and metrics (stats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results = TransferResults()
        self._stats = TransferStats()
        self.wakeup: Callable[[], None] = lambda: None  # set by ConnectorWorker.start()

    # ---- results (each call wakes the engine) -------------------------------------------------------------------
    def recv_finished(
        self, request_id: str, num_bytes: int, seconds: float | None, landed_from: tuple[int, ...] = (),
        first_token: int | None = None,
    ) -> None:  # fmt: skip
        """D may run the request; landed_from: per KV group, the first token whose KV landed; first_token: the
        prefill's first output token, when the KV ends where the prefill's does (TransferResults.first_tokens)."""
        with self._lock:
            self._results.finished_recvs.append(request_id)
            if landed_from:
                self._results.landed_from[request_id] = landed_from
            if first_token is not None:
                self._results.first_tokens[request_id] = first_token
            self._results.events.append((request_id, "kv_received", time.time()))
            self._stats.received_bytes += num_bytes
            self._stats.transfers_ok += 1
            if seconds is not None:
                self._stats.transfer_seconds.append(seconds)
        self.wakeup()

    def recv_failed(self, request_id: str, reason: str, refused: bool = False) -> None:
        """refused: the producer answered that it holds no KV under the recv's coordinates (TransferResults)."""
        with self._lock:
            self._results.failed_recvs.append((request_id, reason))
            if refused:
                self._results.refused_recvs.append(request_id)
            self._stats.transfers_failed += 1
        self.wakeup()

    def recv_cancelled(self, request_id: str) -> None:
        with self._lock:
            self._results.cancelled_recvs.append(request_id)
        self.wakeup()

    def send_finished(
        self, request_id: str, outcome: SendOutcome, num_bytes: int = 0, seconds: float | None = None
    ) -> None:
        """P may free the request's blocks now."""
        with self._lock:
            self._results.finished_sends.append(request_id)
            self._stats.sent_bytes += num_bytes
            if outcome is SendOutcome.OK:
                self._stats.transfers_ok += 1
            elif outcome is SendOutcome.EXPIRED:
                self._stats.transfers_expired += 1
            else:
                self._stats.transfers_failed += 1
            if seconds is not None:
                self._stats.transfer_seconds.append(seconds)
        self.wakeup()

    def posted(self, num_descs: int, post_seconds: float) -> None:
        """A READ or WRITE was posted with `num_descs` descriptors in `post_seconds` (for /metrics)."""
        with self._lock:
            self._stats.posts.append((num_descs, post_seconds))

    def prepared_writes(self, num: int) -> None:
        """P (push): `num` WRITEs are prepared and not yet posted (TransferStats.prepared_writes)."""
        with self._lock:
            self._stats.prepared_writes = num

    def checksum_failed(self) -> None:
        """A recv's received KV did not match the producer's checksum (--kv-checksum; its recv_failed follows)."""
        with self._lock:
            self._stats.checksum_failures += 1

    def event(self, request_id: str, name: str, t: float | None = None) -> None:
        """A timeline event; does not wake the engine (it is picked up with the next result)."""
        with self._lock:
            self._results.events.append((request_id, name, time.time() if t is None else t))

    # ---- readers ------------------------------------------------------------------------------------------------
    def drain(self) -> TransferResults:
        with self._lock:
            out, self._results = self._results, TransferResults()
        return out

    def stats(self) -> TransferStats:
        """A snapshot; transfer_seconds is drained."""
        with self._lock:
            s = self._stats
            snap = TransferStats(
                s.sent_bytes, s.received_bytes, s.transfers_ok, s.transfers_failed, s.transfers_expired,
                s.transfer_seconds, s.posts, s.checksum_failures, prepared_writes=s.prepared_writes,
            )  # fmt: skip
            s.transfer_seconds, s.posts = [], []
        return snap
