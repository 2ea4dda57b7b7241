"""TPWorker: rank 0's ConnectorWorker for a tensor-parallel P/D instance (docs/architecture.md, "Tensor
parallelism"). It wraps rank 0's own worker (its KV slice, NIXL agent, transfer thread, side channel) and the
other ranks' workers, which run in the rank processes (rank.py): each StepMeta goes to rank 0's
worker and, as bytes, to every rank over its pipe (TPGroup.send_transfer); each rank's results come back on
TPGroup's reader thread and are merged by transfer/ranks.RankMerger, so the engine sees one result per
request (base.py states the invariant). A rank that errors or exits breaks the group: poll_results raises
TPGroupError, the engine loop stops and fails every open request (the surviving ranks are shut down with it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdserve.engine.tp.group import TPGroup, TPGroupError
from pdserve.transfer.base import ConnectorWorker, KVCacheSpec, StepMeta, TransferResults, TransferStats
from pdserve.transfer.ranks import RankMerger, add_stats, decode_results, encode_meta


class TPWorker(ConnectorWorker):
    def __init__(self, local: ConnectorWorker, group: TPGroup) -> None:
        self.local = local  # rank 0's worker
        self.group = group
        self.merger = RankMerger(group.size)  # engine thread only
        self._lock = threading.Lock()  # guards _inbox and _stats (the reader thread writes them)
        self._inbox: list[tuple[int, TransferResults]] = []  # ranks 1.. results not merged yet
        self._stats: dict[int, TransferStats] = {}  # rank -> its cumulative counters (last snapshot)
        self._seconds: list[float] = []  # ranks' transfer durations and posts since the last stats()
        self._posts: list[tuple[int, float]] = []
        self._wakeup: Callable[[], None] = lambda: None

    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        self.local.register_kv_cache(kv_cache, spec)

    def start(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup
        self.local.start(wakeup)
        self.group.start_reader(self._on_results, wakeup)

    def _on_results(self, rank: int, data: bytes) -> None:  # the reader thread
        res, stats = decode_results(data)
        with self._lock:
            self._inbox.append((rank, res))
            self._seconds += stats.transfer_seconds
            self._posts += stats.posts
            stats.transfer_seconds, stats.posts = [], []
            self._stats[rank] = stats
        self._wakeup()

    def submit(self, meta: StepMeta) -> None:
        if not meta:
            return
        self.merger.see(meta)
        self._send(meta)

    def _send(self, meta: StepMeta) -> None:
        """meta to every rank's worker (not seen by the merger: a follow-up's cancels are not the engine's)."""
        self.group.send_transfer(encode_meta(meta))
        self.local.submit(meta)

    def poll_results(self) -> TransferResults:
        if self.group.broken is not None:
            raise TPGroupError(self.group.broken)
        with self._lock:
            inbox, self._inbox = self._inbox, []
        self.merger.add(0, self.local.poll_results())
        for rank, res in inbox:
            self.merger.add(rank, res)
        merged, followup = self.merger.take()
        if followup:  # another rank's part of these recvs failed: the others end theirs now (reported failed)
            self._send(followup)
        return merged

    def stats(self) -> TransferStats:
        """Every rank's counters summed (a transfer of N ranks counts N times in transfers_ok)."""
        total = self.local.stats()
        with self._lock:
            for s in self._stats.values():
                total = add_stats(total, s)
            total.transfer_seconds += self._seconds
            total.posts += self._posts
            self._seconds, self._posts = [], []
        return total

    def shutdown(self) -> None:
        self.local.shutdown()  # the other ranks' workers stop with their processes (TPGroup.shutdown)
