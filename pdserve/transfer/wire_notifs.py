"""NIXL notifications between P's and D's transfer threads: pull's release and its ack, push's registration,
keepalive, completion, cancel and refusal.

They travel as NIXL notifications (push's PushDone carried by the WRITE itself), never on the side channel; the
side channel's frames (handshake, liveness, Sealed) stay in wire.py with the codec, which encodes and decodes
these too, under the one WIRE_VERSION whose history is there. Kept apart so each mode's messages read as one
family next to the protocol that sends them (thread/pull*.py, thread/push*.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PullRelease:
    """Notification D -> P (pull): D is done with P's pinned blocks of request_id."""

    request_id: str  # P's request id (remote_request_id in D's params)
    ok: bool  # False: D gave up (P counts the transfer as failed)
    num_bytes: int  # bytes D read
    block_ids: list[int]  # P's blocks D read from (as in P's answer); P frees only a pin with exactly these
    # --kv-checksum: the part of this P rank's KV D read, for P to sum (checksum.py) and answer in the ack:
    checksum_heads: list[int] = field(default_factory=list)  # [first head of P's rank, count]; []: none asked
    checksum_ranges: list[list[int]] = field(default_factory=list)  # per KV group, tokens [first, end) read


@dataclass(frozen=True)
class PullReleaseAck:
    """Notification P -> D (pull): the answer to a PullRelease. D runs the request only on held=True: P's pin
    was still in place (not expired, not released by an abort) when the release arrived, so every byte of the
    READ D completed before sending the release came from the request's own blocks."""

    request_id: str  # P's request id, as in the release
    held: bool
    reason: str  # why not held ("" when held)
    checksum: list[int] = field(default_factory=list)  # [s1, s2] P's sums of what the release asked; [] none
    # not held because P never held KV under these coordinates for this consumer: never pinned here (a made-up
    # id), or released by every consumer rank already (a replay). The request's error; a lease that ran out or
    # an engine release is not (those are the instance's)
    refused: bool = False


@dataclass(frozen=True)
class PushRegister:
    """Notification D -> P (push): write tokens [start_token, start_token + num_tokens) into these blocks."""

    transfer_id: str
    attempt: int  # a newer attempt supersedes older ones; data for an old attempt never lands in a new one
    engine_id: str  # D's engine id
    block_ids: list[int]  # D's blocks covering tokens [0, start_token + num_tokens)
    block_size: int  # D's tokens per block
    start_token: int
    num_tokens: int
    tp_rank: int  # D's rank
    keepalive_ms: int  # while the prefill is queued or running on P, P sends PushQueued at least this often
    block_tables: list[list[int]]  # windowed model: D's table per KV group (-1: STALE); []: one group, block_ids


@dataclass(frozen=True)
class PushQueued:
    """Notification P -> D (push): P has this attempt's registration and its prefill is queued or running;
    D's receive clock restarts (sent at once, then every keepalive_ms). Unknown transfers get no PushQueued."""

    transfer_id: str
    attempt: int


@dataclass(frozen=True)
class PushDone:
    """Notification P -> D carried by the WRITE (arrives after the data): one producer rank has written."""

    transfer_id: str
    attempt: int
    producer_rank: int
    num_producers: int  # completions D must count before the request may run
    num_bytes: int
    checksum: list[int] = field(default_factory=list)  # --kv-checksum: [s1, s2] of this rank's part; [] off
    # the token P sampled after the prompt, when the registration's tokens end where P's KV ends: D's first
    # output token, which D emits without computing the last prompt token; -1: none
    first_token_id: int = -1


@dataclass(frozen=True)
class PushCancel:
    """Notification D -> P (push): D gives up on this attempt; answer with PushCancelAck. P gives the transfer
    up too (frees its prefill now) unless that D rank registered a newer attempt or this one's data landed."""

    transfer_id: str
    attempt: int  # -1: D refused the request before registering (thread/give_back.py); not answered


@dataclass(frozen=True)
class PushCancelAck:
    """Notification P -> D: nothing more will be written for this attempt."""

    transfer_id: str
    attempt: int
    producer_rank: int
    landed: bool  # this rank's write completed before the cancel (its data is in D's blocks)


@dataclass(frozen=True)
class PushFail:
    """Notification P -> D: P will never write this attempt (expired, aborted, error); D's blocks are safe."""

    transfer_id: str
    attempt: int
    reason: str
