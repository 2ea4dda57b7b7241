"""Capabilities on kv_transfer_params: coordinates are issued (signed) and checked, never trusted.

Who issues, who checks, over what (auth.Signer, HMAC-SHA256 with the deployment secret):
  pull  P signs its answer (PullSource) when the request finishes, purpose "pull", over
        [engine id, side-channel host, port, request id, block ids, num tokens, block size, tp size,
         expires_at, prompt digest, block tables, first token id] where the digest is auth.prompt_digest of the
        tokens [0, num tokens) whose KV P computed; it expires with P's lease (after it the blocks may hold
        another request's KV). The first token is D's first output token (D emits it without computing it), so
        it is P's as much as the KV is: a client cannot alter it.
        D checks it at its HTTP edge, and that the digest equals the digest of its own prompt's first
        num_tokens tokens: KV that enters D (and its prefix cache) is P's KV of exactly these tokens.
  push  the router signs, purpose "push", over [transfer id, P's engine id, P's side-channel host, port,
        expires_at]; the same capability goes on both legs. P checks it on the RemoteDecode leg (against its
        own engine id and address), D on the PushSource leg (against the coordinates it will dial).
Every instance refuses a capability it has seen before (ReplayGuard keyed by the MAC, per instance).

Checked before the engine allocates a block or the transfer thread dials anything. Without a secret nothing
is signed or checked (`KVAuth(None)`); an instance says so once at startup (server/cli.py), and D dials only a
loopback address a client names (unless started with --insecure-no-kv-auth: `allow_unsigned_remote`), so a
client cannot make it send its peer info to any host:port.
Pure Python: the router imports it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdserve.auth import INSECURE_FLAG, AuthError, ReplayGuard, Signer, TokenIds, is_loopback, prompt_digest
from pdserve.kv.params import Capability, KVTransferParams, PullSource, PushSource, RemoteDecode

PULL = "pull"
PUSH = "push"


def pull_fields(src: PullSource, expires_at: float, digest: str | None) -> list[object]:
    """What a pull capability's MAC covers (the order is the format: change it and bump nothing else)."""
    return [
        src.engine_id, src.host, src.port, src.request_id, list(src.block_ids), src.num_tokens, src.block_size,
        src.tp_size, expires_at, digest, [list(t) for t in src.block_tables], src.first_token_id,
    ]  # fmt: skip


def push_fields(transfer_id: str, engine_id: str | None, host: str, port: int, expires_at: float) -> list[object]:
    """What a push capability's MAC covers."""
    return [transfer_id, engine_id, host, port, expires_at]


class KVAuth:
    """Issues and checks capabilities for one instance (or the router). `KVAuth(None)`: nothing signed or
    checked. issue_* may run on any thread; check() keeps the replay memory and runs on the event loop only."""

    def __init__(
        self, secret: bytes | None, clock: Callable[[], float] = time.time, allow_unsigned_remote: bool = False
    ) -> None:
        self._signer = Signer(secret) if secret else None
        self._allow_unsigned_remote = allow_unsigned_remote  # without a secret: dial peers beyond loopback
        self._replays = ReplayGuard()
        self._clock = clock

    @property
    def is_enabled(self) -> bool:
        return self._signer is not None

    # ---- issue --------------------------------------------------------------------------------------------------
    def issue_pull(self, src: PullSource, token_ids: Sequence[int], ttl_s: float) -> PullSource:
        """src with P's capability over it and the digest of token_ids[:src.num_tokens] (src unchanged when
        there is no secret)."""
        if self._signer is None:
            return src
        expires_at = round(self._clock() + ttl_s, 3)
        digest = prompt_digest(token_ids[: src.num_tokens])
        mac = self._signer.sign(PULL, pull_fields(src, expires_at, digest))
        return dataclasses.replace(src, capability=Capability(expires_at, mac, digest))

    def issue_push(self, transfer_id: str, engine_id: str, host: str, port: int, ttl_s: float) -> Capability | None:
        """The router's capability for one push transfer (both legs carry it); None when there is no secret."""
        if self._signer is None:
            return None
        expires_at = round(self._clock() + ttl_s, 3)
        return Capability(
            expires_at, self._signer.sign(PUSH, push_fields(transfer_id, engine_id, host, port, expires_at))
        )

    # ---- check --------------------------------------------------------------------------------------------------
    def check(self, params: KVTransferParams | None, prompt_ids: TokenIds, local: Mapping[str, Any]) -> None:
        """Raise AuthError naming the problem when params carry coordinates that were not issued to this request:
        unsigned, forged or altered, expired, already used, or (pull) for other tokens than this prompt's.
        `local` is this instance's /kv_transfer/info (a push P checks that the capability names it)."""
        if params is None:
            return
        if self._signer is None:
            self._check_unsigned_address(params)
            return
        if isinstance(params, RemoteDecode):
            if params.transfer_id is None and params.capability is None:
                return  # a pull prefill leg names nothing: P issues the capability itself
            if params.transfer_id is None:
                raise AuthError("kv_capability on a prefill leg without transfer_id")
            fields = push_fields(
                params.transfer_id, local.get("engine_id"), local.get("side_channel_host", ""),
                local.get("side_channel_port", 0), self._expiry(params.capability),
            )  # fmt: skip
            self._verify(PUSH, fields, params.capability)
        elif isinstance(params, PushSource):
            fields = push_fields(
                params.transfer_id, params.engine_id, params.host, params.port, self._expiry(params.capability)
            )
            self._verify(PUSH, fields, params.capability)
        else:
            cap = params.capability
            self._verify(PULL, pull_fields(params, self._expiry(cap), cap.prompt_digest if cap else None), cap)
            assert cap is not None  # _verify refused a missing one
            if params.num_tokens > len(prompt_ids) or cap.prompt_digest != _digest(prompt_ids[: params.num_tokens]):
                raise AuthError(
                    f"kv_capability: the KV it names is of other tokens than this prompt's first {params.num_tokens}"
                )
        cap = params.capability
        assert cap is not None
        if not self._replays.first_use(cap.mac, cap.expires_at, self._clock()):
            raise AuthError("kv_capability was already used (replayed)")

    def check_release(
        self,
        request_id: str | None,
        transfer_id: str | None,
        params: KVTransferParams | None,
        local: Mapping[str, Any],
    ) -> None:
        """Raise AuthError unless `params` prove that the caller was given this request's coordinates: P's pull
        answer naming `request_id` and this instance, or the push capability of `transfer_id` for this instance.
        The MAC alone is checked: giving KV up needs no fresh capability (an expired one is still the caller's) and
        does not use it up. Without a secret nothing can be checked (docs/deploy.md)."""
        if self._signer is None:
            return
        cap = params.capability if isinstance(params, (PullSource, RemoteDecode)) else None
        if cap is None:
            raise AuthError(
                "releasing a request needs its kv_capability in kv_transfer_params (pull: P's answer; push: the "
                "prefill leg's params) or the deployment's internal API key; its id alone is not enough"
            )
        if request_id is not None:
            if not isinstance(params, PullSource) or params.request_id != request_id:
                raise AuthError(f"kv_transfer_params are not P's answer for request_id {request_id!r}")
            if params.engine_id != local.get("engine_id"):
                raise AuthError("kv_transfer_params name another prefill instance")
            purpose, fields = PULL, pull_fields(params, cap.expires_at, cap.prompt_digest)
        else:
            if not isinstance(params, RemoteDecode) or transfer_id is None or params.transfer_id != transfer_id:
                raise AuthError(f"kv_transfer_params are not the prefill leg's for transfer_id {transfer_id!r}")
            fields = push_fields(
                transfer_id, local.get("engine_id"), local.get("side_channel_host", ""),
                local.get("side_channel_port", 0), cap.expires_at,
            )  # fmt: skip
            purpose = PUSH
        if not self._signer.verify(purpose, fields, cap.mac):
            raise AuthError(f"kv_capability does not match the {purpose} coordinates (forged or altered)")

    def _check_unsigned_address(self, params: KVTransferParams) -> None:
        """Without a secret nobody vouches for the address a D leg names: dial only loopback (or what the
        operator allowed)."""
        host = params.host if isinstance(params, PullSource | PushSource) else None
        if host is not None and not self._allow_unsigned_remote and not is_loopback(host):
            raise AuthError(
                f"kv_transfer_params name the prefill instance at {host}, which is not a loopback address; without "
                f"a deployment secret this instance dials only loopback peers (start the deployment with "
                f"--kv-auth-secret-file, or this instance with {INSECURE_FLAG})"
            )

    def may_give_back(self, params: PullSource | PushSource) -> bool:
        """D, a request refused before admission: whether the KV its coordinates name may be handed back to their
        producer now. Without a secret always (the coordinates are the proof, as in D's PullRelease); with one,
        only when they carry a capability whose MAC holds for exactly these coordinates (expired, or for another
        prompt, is fine: whoever holds it was given that KV) that this instance has not admitted before (a
        replay: the admitted request's own transfer ends the pin). A request whose own check() used it knows that
        itself (server/refusal.py).
        Without a secret, never to a host this instance would not dial for the request itself (not loopback)."""
        if self._signer is None:
            return self._allow_unsigned_remote or is_loopback(params.host)
        cap = params.capability
        if cap is None or cap.mac in self._replays:
            return False
        if isinstance(params, PushSource):
            fields = push_fields(params.transfer_id, params.engine_id, params.host, params.port, cap.expires_at)
            return self._signer.verify(PUSH, fields, cap.mac)
        return self._signer.verify(PULL, pull_fields(params, cap.expires_at, cap.prompt_digest), cap.mac)

    def _expiry(self, cap: Capability | None) -> float:
        return cap.expires_at if cap is not None else 0.0

    def _verify(self, purpose: str, fields: list[object], cap: Capability | None) -> None:
        assert self._signer is not None
        if cap is None:
            raise AuthError("kv_transfer_params are unsigned (no kv_capability) and this instance requires one")
        if not self._signer.verify(purpose, fields, cap.mac):
            raise AuthError(f"kv_capability does not match the {purpose} coordinates (forged or altered)")
        if cap.expires_at <= self._clock():
            raise AuthError(f"kv_capability expired {self._clock() - cap.expires_at:.0f} s ago")


def _digest(token_ids: TokenIds) -> str | None:
    """The prompt digest of a client's token ids; None when they cannot be digested (an id outside int64: no
    capability names such tokens)."""
    try:
        return prompt_digest(token_ids)
    except ValueError:
        return None
