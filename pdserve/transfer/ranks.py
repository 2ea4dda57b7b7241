"""Tensor parallelism across the connector seam: rank 0's StepMeta to the other ranks' workers and their
TransferResults back (explicit msgpack, never pickle), and RankMerger, which turns every rank's results into
the one result per request the engine expects (the invariant is in base.py). Pure Python (msgpack only).

Encoding: a msgpack map {"v": RANKS_VERSION, ...}; RecvTask.source goes as its kv_transfer_params object
(kv.params.encode / kv.decode.decode), so one translation exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from pdserve.kv.decode import decode as decode_params
from pdserve.kv.params import PullSource, PushSource
from pdserve.kv.params import encode as encode_params
from pdserve.transfer.base import RecvTask, SendTask, StepMeta, TransferResults, TransferStats

# 1: StepMeta and TransferResults + TransferStats between the ranks of one instance (2026-12-03).
# 2: RecvTask/SendTask block_tables (sliding-window models: a table per KV group) (2026-12-04).
# 3: TransferResults.landed_from (per finished recv, each KV group's first token landed) (2026-12-05).
# 4: TransferStats.checksum_failures (--kv-checksum) (2026-12-03).
# 5: StepMeta.refusals (D: coordinates of requests refused before admission, for their producer) (2026-12-03).
# 6: TransferResults.refused_recvs (recvs whose producer holds no KV under their coordinates) (2026-12-03).
# 7: SendTask.first_token_id (push: every P rank's PushDone carries it) and TransferResults.first_tokens (D's
#    first output token, handed over with the KV) (2026-12-03).
# 8: StepMeta.planned (push: P's blocks for a prefill still running, its WRITEs laid out ahead) and
#    TransferStats.prepared_writes (2026-12-03).
RANKS_VERSION = 8


class RanksError(ValueError):
    """A message between ranks that is not of this version."""


def encode_meta(meta: StepMeta) -> bytes:
    recvs = [[r.request_id, list(r.block_ids), r.start_token, r.num_tokens, encode_params(r.source), r.attempt,
              [list(t) for t in r.block_tables]] for r in meta.recvs]  # fmt: skip
    return msgpack.packb(
        {"v": RANKS_VERSION, "recvs": recvs, "sends": _encode_sends(meta.sends), "cancels": meta.cancels,
         "expected": [list(e) for e in meta.expected], "abandoned": meta.abandoned, "releases": meta.releases,
         "refusals": [encode_params(s) for s in meta.refusals], "planned": _encode_sends(meta.planned)},
    )  # fmt: skip


def _encode_sends(sends: list[SendTask]) -> list[list[Any]]:
    return [[s.request_id, list(s.block_ids), s.num_tokens, s.transfer_id, [list(t) for t in s.block_tables],
             s.first_token_id] for s in sends]  # fmt: skip


def _decode_sends(sends: list[list[Any]]) -> list[SendTask]:
    return [SendTask(rid, tuple(blocks), num, tid, _tables(tables), first)
            for rid, blocks, num, tid, tables, first in sends]  # fmt: skip


def decode_meta(data: bytes) -> StepMeta:
    m = _map(data)
    recvs = []
    for rid, blocks, start, num, source, attempt, tables in m["recvs"]:
        src = decode_params(source)
        if not isinstance(src, PullSource | PushSource):
            raise RanksError(f"recv {rid}: its source is not a prefill's coordinates")
        recvs.append(RecvTask(rid, tuple(blocks), start, num, src, attempt, _tables(tables)))
    sends = _decode_sends(m["sends"])
    refusals: list[PullSource | PushSource] = []
    for raw in m["refusals"]:
        src = decode_params(raw)
        if not isinstance(src, PullSource | PushSource):
            raise RanksError("a refusal's source is not a prefill's coordinates")
        refusals.append(src)
    return StepMeta(recvs, sends, list(m["cancels"]), [(a, b) for a, b in m["expected"]], list(m["abandoned"]),
                    list(m["releases"]), refusals, _decode_sends(m["planned"]))  # fmt: skip


def _tables(tables: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in tables)


def encode_results(res: TransferResults, stats: TransferStats) -> bytes:
    return msgpack.packb(
        {"v": RANKS_VERSION, "finished_recvs": res.finished_recvs, "failed_recvs": res.failed_recvs,
         "refused_recvs": res.refused_recvs, "cancelled_recvs": res.cancelled_recvs,
         "finished_sends": res.finished_sends, "events": res.events,
         "landed_from": [[rid, list(firsts)] for rid, firsts in res.landed_from.items()],
         "first_tokens": list(res.first_tokens.items()),
         "stats": [stats.sent_bytes, stats.received_bytes, stats.transfers_ok, stats.transfers_failed,
                   stats.transfers_expired, stats.transfer_seconds, stats.posts, stats.checksum_failures,
                   stats.prepared_writes]},
    )  # fmt: skip


def decode_results(data: bytes) -> tuple[TransferResults, TransferStats]:
    m = _map(data)
    res = TransferResults(
        finished_recvs=list(m["finished_recvs"]),
        failed_recvs=[(a, b) for a, b in m["failed_recvs"]],
        refused_recvs=list(m["refused_recvs"]),
        cancelled_recvs=list(m["cancelled_recvs"]),
        finished_sends=list(m["finished_sends"]),
        events=[(a, b, c) for a, b, c in m["events"]],
        landed_from={rid: tuple(firsts) for rid, firsts in m["landed_from"]},
        first_tokens={rid: token for rid, token in m["first_tokens"]},
    )
    s = m["stats"]
    stats = TransferStats(s[0], s[1], s[2], s[3], s[4], list(s[5]), [(a, b) for a, b in s[6]], s[7],
                          prepared_writes=s[8])  # fmt: skip
    return res, stats


def _map(data: bytes) -> dict[str, Any]:
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise RanksError(f"not msgpack: {e}") from None
    if not isinstance(m, dict) or m.get("v") != RANKS_VERSION:
        raise RanksError(f"not a rank message of version {RANKS_VERSION}")
    return m


@dataclass
class _Recv:
    """One request's recv across the ranks."""

    ends: dict[int, str] = field(default_factory=dict)  # rank -> "finished" | "failed" | "cancelled"
    reason: str = ""  # the first failure's
    refused: bool = False  # the first failure was the producer refusing the coordinates (TransferResults)
    engine_cancelled: bool = False  # the engine aborted it (reported as cancelled)
    cancels_sent: bool = False  # the other ranks were asked to cancel after a failure
    landed_from: tuple[int, ...] = ()  # per KV group, the latest first token landed any rank reported
    # the prefill's first output token, as the ranks reported it (they agree: every P rank's SendTask and every
    # D rank's PullSource carry rank 0's); None while no rank reported one
    first_token: int | None = None


class RankMerger:
    """Rank 0's view of every rank's results (engine thread only). Fed the StepMeta each rank gets (see()) and
    each rank's results (add()); take() returns the merged results and the StepMeta the ranks must get next
    (cancels of the parts of a recv another rank failed)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._recvs: dict[str, _Recv] = {}
        self._sends: dict[str, set[int]] = {}  # request id -> ranks whose part of the send is over
        self._out = TransferResults()
        self._followup = StepMeta()

    def see(self, meta: StepMeta) -> None:
        for r in meta.recvs:
            self._recvs[r.request_id] = _Recv()
        for rid in meta.cancels:
            if (rv := self._recvs.get(rid)) is not None:
                rv.engine_cancelled = True

    def add(self, rank: int, res: TransferResults) -> None:
        self._out.events.extend(res.events)
        for rid in res.finished_recvs:
            self._recv_end(rank, rid, "finished", "", res.landed_from.get(rid, ()), res.first_tokens.get(rid))
        refused = set(res.refused_recvs)
        for rid, reason in res.failed_recvs:
            self._recv_end(rank, rid, "failed", reason, refused=rid in refused)
        for rid in res.cancelled_recvs:
            self._recv_end(rank, rid, "cancelled", "")
        for rid in res.finished_sends:
            ranks = self._sends.setdefault(rid, set())
            ranks.add(rank)
            if len(ranks) == self.num_ranks:
                del self._sends[rid]
                self._out.finished_sends.append(rid)

    def _recv_end(
        self, rank: int, rid: str, end: str, reason: str, landed_from: tuple[int, ...] = (),
        first_token: int | None = None, refused: bool = False,
    ) -> None:  # fmt: skip
        rv = self._recvs.get(rid)
        if rv is None:
            return  # not a recv this instance started (never: every rank gets the same StepMeta)
        rv.ends[rank] = end
        if first_token is not None:
            rv.first_token = first_token
        if landed_from:  # every rank's P peers share one block size, so the ranks agree; keep the latest anyway
            mine = rv.landed_from or landed_from
            rv.landed_from = tuple(max(a, b) for a, b in zip(mine, landed_from, strict=True))
        if end == "failed" and not rv.reason:
            rv.reason = reason if self.num_ranks == 1 else f"tensor-parallel rank {rank}: {reason}"
            rv.refused = refused
        if end == "failed" and not rv.cancels_sent and len(rv.ends) < self.num_ranks:
            rv.cancels_sent = True  # the other ranks' parts end early (nothing more lands, then they report)
            self._followup.cancels.append(rid)
        if len(rv.ends) < self.num_ranks:
            return
        del self._recvs[rid]
        if rv.engine_cancelled:
            self._out.cancelled_recvs.append(rid)
        elif all(e == "finished" for e in rv.ends.values()):
            self._out.finished_recvs.append(rid)
            if rv.landed_from:
                self._out.landed_from[rid] = rv.landed_from
            if rv.first_token is not None:
                self._out.first_tokens[rid] = rv.first_token
        else:
            self._out.failed_recvs.append((rid, rv.reason or "a tensor-parallel rank cancelled its part"))
            if rv.refused:
                self._out.refused_recvs.append(rid)

    def take(self) -> tuple[TransferResults, StepMeta]:
        out, self._out = self._out, TransferResults()
        followup, self._followup = self._followup, StepMeta()
        return out, followup


def add_stats(a: TransferStats, b: TransferStats) -> TransferStats:
    return TransferStats(
        a.sent_bytes + b.sent_bytes, a.received_bytes + b.received_bytes, a.transfers_ok + b.transfers_ok,
        a.transfers_failed + b.transfers_failed, a.transfers_expired + b.transfers_expired,
        a.transfer_seconds + b.transfer_seconds, a.posts + b.posts, a.checksum_failures + b.checksum_failures,
        {k: a.side_channel_refused.get(k, 0) + b.side_channel_refused.get(k, 0)
         for k in a.side_channel_refused.keys() | b.side_channel_refused.keys()},
        a.prepared_writes + b.prepared_writes,
    )  # fmt: skip
