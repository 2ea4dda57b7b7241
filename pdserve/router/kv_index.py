"""The router's picture of what each instance holds in its prefix cache, fed from the instances' GET /kv_events.

One `InstanceIndex` per instance URL (`KVIndex` holds them): the set of block keys (kv/block_hashes.py) the
instance's last answers named, with its epoch, seq and block size. It answers one question for the scorer: how
many leading blocks of a prompt the instance holds (`hit_blocks`: stop at the first miss, as the engine's prefix
cache does).

Rules (issue 29; tests/router/test_kv_index.py):
- a snapshot replaces the set; events are applied in order; an answer that does not follow the index's seq
  (a gap the instance did not mark), comes from another epoch without a snapshot, or names another hash
  scheme makes the index unusable until the next snapshot (`InstanceIndex.apply` raises KVIndexError: the
  stream that fed it closes and starts over with a snapshot);
- an unusable index (never synced, stream lost, another hash scheme) scores as empty: the instance is then
  chosen by load alone;
- bounded memory: at most `max_keys` keys per instance; past it the least recently stored or hit keys go
  first (a shared system prompt's blocks are hit by every request, so they stay). Forgetting a key the
  instance still holds only costs a miss in the router's estimate, never a wrong answer;
- only KV group 0's keys are kept (16 bytes; a windowed group's 18-byte keys are skipped): a prompt is scored by
  its full-attention blocks.
Pure Python; used from the router's event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv.block_hashes import HASH_SCHEME, BlockHash
from pdserve.kv.events_wire import KVEventsAnswer

DEFAULT_MAX_KEYS = 262_144  # per instance (~30 MB of dict entries); an H200 holds ~60k 16-token blocks of a 0.6B
GROUP0_KEY_BYTES = 16  # kv/block_hashes.py: a group-0 key is the bare 16-byte digest


class KVIndexError(ValueError):
    """An answer that cannot be applied to the index (the message says why); the index is then unusable."""


class HashSchemeError(KVIndexError):
    """A snapshot hashed with another scheme: that instance is not followed until its epoch changes."""

    def __init__(self, message: str, epoch: str) -> None:
        super().__init__(message)
        self.epoch = epoch  # the instance process whose scheme differs


@dataclass(frozen=True)
class SnapshotKeys:
    """A snapshot's keys as an index holds them (group 0 only, the cap applied), built by `snapshot_keys` off the
    event loop and swapped in by `InstanceIndex.apply`."""

    keys: OrderedDict[BlockHash, None]  # in the snapshot's order (its last keys kept when over the cap)
    num_evicted: int  # keys dropped for the cap


def snapshot_keys(keys: Sequence[bytes], max_keys: int) -> SnapshotKeys:
    group0 = [k for k in keys if len(k) == GROUP0_KEY_BYTES]  # a windowed group's keys are skipped
    num_evicted = max(len(group0) - max_keys, 0)
    # a generator, not OrderedDict.fromkeys: run in a worker thread, its bytecode lets the event loop's thread
    # take the GIL between keys (fromkeys is one C call: 262k keys held it ~0.2-0.9 s)
    return SnapshotKeys(OrderedDict((k, None) for k in group0[num_evicted:]), num_evicted)


@dataclass(frozen=True)
class IndexState:
    """What /metrics and the log say about one instance's index."""

    url: str  # the instance
    usable: bool  # synced from a snapshot and every answer since: scores count its keys
    num_keys: int  # keys held now
    epoch: str | None  # the instance process the keys belong to
    seq: int | None  # the instance's event seq the keys match
    block_size: int | None  # tokens per block, from the instance's last snapshot


class InstanceIndex:
    """One instance's cached block keys, as its /kv_events answers told them."""

    def __init__(self, url: str, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.url = url  # the instance's base URL
        self.max_keys = max_keys  # cap on len(self._keys)
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()  # oldest (least recently stored or hit) first
        self.epoch: str | None = None  # set by a snapshot
        self.seq: int | None = None  # the seq the keys match; None: not synced (send no `after`)
        self.block_size: int | None = None  # from the last snapshot
        self.usable = False  # a snapshot was applied, with our hash scheme, and every answer since
        self.num_evicted = 0  # keys dropped for the cap since the router started

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def state(self) -> IndexState:
        return IndexState(self.url, self.usable, len(self._keys), self.epoch, self.seq, self.block_size)

    def reset(self) -> None:
        """Forget everything (the stream was lost, or the instance is silent): scored as empty until the next
        snapshot, which the next poll asks for (no `after`)."""
        self._keys.clear()
        self.epoch = self.seq = self.block_size = None
        self.usable = False

    def apply(self, answer: KVEventsAnswer, built: SnapshotKeys | None = None) -> None:
        """Apply one decoded /kv_events answer (a snapshot's keys may come `built` by snapshot_keys); raises
        KVIndexError (after resetting) when it cannot be."""
        try:
            self._apply(answer, built)
        except KVIndexError:
            self.reset()
            raise

    def _apply(self, answer: KVEventsAnswer, built: SnapshotKeys | None) -> None:
        snap = answer.snapshot
        if snap is not None:
            if snap.hash_scheme != HASH_SCHEME:
                raise HashSchemeError(
                    f"instance {self.url} hashes its blocks with {snap.hash_scheme}, this router with {HASH_SCHEME} "
                    "(another pdserve version?): its cache is not scored (load only) until it restarts with ours",
                    answer.epoch,
                )
            built = built or snapshot_keys(snap.keys, self.max_keys)
            self._keys = built.keys
            self.num_evicted += built.num_evicted
            self.epoch, self.seq, self.block_size = answer.epoch, answer.seq, snap.block_size
            self.usable = snap.prefix_caching
            return
        if self.seq is None or answer.epoch != self.epoch:
            raise KVIndexError(
                f"instance {self.url} sent events of epoch {answer.epoch} at seq {answer.seq} to an index "
                f"{'never synced' if self.seq is None else f'of epoch {self.epoch}'} (expected a snapshot)"
            )
        if answer.seq - answer.num_events != self.seq:
            raise KVIndexError(
                f"instance {self.url} sent {answer.num_events} events ending at seq {answer.seq}; the index is at "
                f"seq {self.seq}"
            )
        for stored, keys in answer.events:
            if stored:
                self._store(keys)
            else:
                for key in keys:
                    self._keys.pop(key, None)
        self.seq = answer.seq

    def _store(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if len(key) != GROUP0_KEY_BYTES:
                continue  # a windowed group's key (module docstring)
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
            self.num_evicted += 1

    def hit_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt (its keys at this instance's block size) the instance holds,
        stopping at the first miss; 0 when the index is unusable. Hits count as recent use (eviction order)."""
        if not self.usable:
            return 0
        num = 0
        for key in block_hashes:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            num += 1
        return num


class KVIndex:
    """Every known instance's index, by URL. Answers for a URL it was not built with are ignored."""

    def __init__(self, urls: Sequence[str], max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.instances = {url: InstanceIndex(url, max_keys) for url in dict.fromkeys(urls)}  # URL -> its index
        self.num_ignored = 0  # answers for unknown instances (ignored)

    def get(self, url: str) -> InstanceIndex | None:
        return self.instances.get(url)

    def apply(self, url: str, answer: KVEventsAnswer, built: SnapshotKeys | None = None) -> bool:
        """Apply `answer` to `url`'s index; False (and nothing changes) when `url` is not a known instance.
        Raises KVIndexError as InstanceIndex.apply does."""
        index = self.instances.get(url)
        if index is None:
            self.num_ignored += 1
            return False
        index.apply(answer, built)
        return True
