"""GET /kv_events, the answer of one long poll: which full blocks entered and left an instance's prefix cache.

One JSON object per poll (version 1):

    {"version": 1,
     "epoch": "3f2a...",        # the instance process's identity (/health's): another one = it restarted
     "seq": 1234,               # after applying this answer, the consumer's set is the cache's at this seq;
                                # send it back as `after` (with `epoch`) in the next poll
     "snapshot": null | {"reason": "first" | "epoch" | "gap",   # why a snapshot instead of events
                         "block_size": 16, "prefix_caching": true,
                         "hash": {"name": "blake2b-128-chain", ...},   # kv/block_hashes.HASH_SCHEME
                         "block_hashes": ["hex", ...]},               # every key cached at seq
     "events": [["stored", ["hex", ...]], ["removed", ["hex", ...]], ...]}

A consumer keeps one set of keys per instance: a snapshot replaces it (its events list is empty); otherwise the
runs of events are applied in order (stored: add, removed: discard). The events of one answer are the seqs
after+1 .. seq, one per key, so their count is seq - after. Keys are hex: 16 bytes for KV group 0, 18 for a
windowed group (kv/block_hashes.py). `decode_answer` checks all of that and raises ValueError naming what is wrong.
Pure Python: the router decodes what the server encodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KV_EVENTS_VERSION = 1  # 1: first version (snapshot or ordered runs of stored/removed hex keys, epoch, seq)
SNAPSHOT_REASONS = ("first", "epoch", "gap")  # no `after`; another epoch's `after`; `after` no longer held
_KINDS = {"stored": True, "removed": False}


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Every key in an instance's prefix cache at the answer's seq, and how to hash prompts the same way."""

    reason: str  # one of SNAPSHOT_REASONS
    block_size: int  # tokens per block
    prefix_caching: bool  # False: the instance caches nothing (no events will come)
    hash_scheme: dict[str, Any]  # kv/block_hashes.HASH_SCHEME of the instance
    keys: list[bytes]  # in no particular order


@dataclass(frozen=True)
class KVEventsAnswer:
    """One poll's answer (module docstring)."""

    epoch: str  # the instance process's identity
    seq: int  # the consumer's set after applying this answer is the cache's at this seq
    snapshot: KVCacheSnapshot | None = None  # set: replaces the consumer's set (then events is empty)
    events: list[tuple[bool, list[bytes]]] = field(default_factory=list)  # (stored?, keys) runs, in order

    @property
    def num_events(self) -> int:
        return sum(len(keys) for _, keys in self.events)


def runs(kinds: bytes, keys: list[bytes], stored: int = 1) -> list[tuple[bool, list[bytes]]]:
    """Events (a kind per key; `stored` marks a stored one) as runs of one kind, in order."""
    out: list[tuple[bool, list[bytes]]] = []
    for kind, key in zip(kinds, keys, strict=True):
        is_stored = kind == stored
        if not out or out[-1][0] != is_stored:
            out.append((is_stored, []))
        out[-1][1].append(key)
    return out


def encode_answer(answer: KVEventsAnswer) -> dict[str, Any]:
    snap = answer.snapshot
    return {
        "version": KV_EVENTS_VERSION,
        "epoch": answer.epoch,
        "seq": answer.seq,
        "snapshot": None
        if snap is None
        else {
            "reason": snap.reason,
            "block_size": snap.block_size,
            "prefix_caching": snap.prefix_caching,
            "hash": snap.hash_scheme,
            "block_hashes": [k.hex() for k in snap.keys],
        },
        "events": [["stored" if s else "removed", [k.hex() for k in keys]] for s, keys in answer.events],
    }


def _int(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _keys(value: Any, what: str) -> list[bytes]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of hex strings, got {type(value).__name__}")
    try:
        return [bytes.fromhex(k) for k in value]
    except (TypeError, ValueError):
        raise ValueError(f"{what} holds a value that is not a hex string") from None


def decode_answer(body: Any, after: int | None = None) -> KVEventsAnswer:
    """An answer from its JSON value; `after`: the seq the poll sent (checks the events' count). ValueError
    names what is malformed."""
    if not isinstance(body, dict):
        raise ValueError(f"a /kv_events answer is a JSON object, got {type(body).__name__}")
    if body.get("version") != KV_EVENTS_VERSION:
        raise ValueError(f"/kv_events version {body.get('version')!r}, this side speaks {KV_EVENTS_VERSION}")
    epoch = body.get("epoch")
    if not isinstance(epoch, str) or not epoch:
        raise ValueError(f"epoch must be a non-empty string, got {epoch!r}")
    seq = _int(body.get("seq"), "seq", 0)
    raw_events = body.get("events")
    if not isinstance(raw_events, list):
        raise ValueError(f"events must be a list, got {type(raw_events).__name__}")
    events: list[tuple[bool, list[bytes]]] = []
    for i, run in enumerate(raw_events):
        if not (isinstance(run, list) and len(run) == 2 and run[0] in _KINDS):
            raise ValueError(f'events[{i}] must be ["stored" or "removed", [hex, ...]]')
        events.append((_KINDS[run[0]], _keys(run[1], f"events[{i}]")))
    answer = KVEventsAnswer(epoch, seq, _snapshot(body.get("snapshot")), events)
    if answer.snapshot is not None and events:
        raise ValueError("an answer with a snapshot carries no events")
    if answer.snapshot is None and after is not None and answer.num_events != seq - after:
        raise ValueError(f"{answer.num_events} events from seq {after} to {seq}: expected {seq - after}")
    return answer


def _snapshot(value: Any) -> KVCacheSnapshot | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"snapshot must be an object or null, got {type(value).__name__}")
    reason, caching, scheme = value.get("reason"), value.get("prefix_caching"), value.get("hash")
    if reason not in SNAPSHOT_REASONS:
        raise ValueError(f"snapshot.reason must be one of {list(SNAPSHOT_REASONS)}, got {reason!r}")
    if not isinstance(caching, bool):
        raise ValueError(f"snapshot.prefix_caching must be a boolean, got {caching!r}")
    if not isinstance(scheme, dict):
        raise ValueError(f"snapshot.hash must be an object, got {scheme!r}")
    block_size = _int(value.get("block_size"), "snapshot.block_size", 1)
    return KVCacheSnapshot(
        reason, block_size, caching, scheme, _keys(value.get("block_hashes"), "snapshot.block_hashes")
    )
