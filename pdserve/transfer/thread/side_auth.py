"""The side channel's authentication with the deployment secret (handshake.py's frames; auth.py's Signer).

Every request and reply travels as a wire.Sealed: the client proves the secret with an HMAC over a fresh nonce,
its clock and the request; the server checks it (clock within MAX_CLOCK_SKEW_S, each nonce once) before the
handler sees anything, and answers with an HMAC over the client's nonce and the reply, which the client checks.
"""

from __future__ import annotations

import hashlib
import time

from pdserve.auth import MAX_CLOCK_SKEW_S, ReplayGuard, Signer, new_nonce
from pdserve.transfer.wire import Message, Refused, Sealed, decode, encode

CLIENT, SERVER = "side-channel-client", "side-channel-server"  # the Signer purposes of the two directions


class PeerRefused(Exception):
    """The other end refused our request (or its reply failed authentication); the message says why."""


def _mac_fields(nonce: str, ts_ms: int, body: bytes) -> list[object]:
    return [nonce, ts_ms, hashlib.sha256(body).hexdigest()]


class SideChannelAuth:
    """Seals and opens side-channel frames with the deployment secret (side-channel thread only)."""

    def __init__(self, secret: bytes) -> None:
        self._signer = Signer(secret)
        self._nonces = ReplayGuard()

    def seal_request(self, msg: Message) -> Sealed:
        body, nonce, ts_ms = encode(msg), new_nonce(), int(time.time() * 1000)
        return Sealed(nonce, ts_ms, self._signer.sign(CLIENT, _mac_fields(nonce, ts_ms, body)), body)

    def open_request(self, frame: Message) -> Message:
        """The request inside a client's frame; raises PeerRefused naming the failed check."""
        if not isinstance(frame, Sealed):
            raise PeerRefused("not authenticated: this side channel requires the deployment secret")
        if not self._signer.verify(CLIENT, _mac_fields(frame.nonce, frame.ts_ms, frame.body), frame.mac):
            raise PeerRefused("not authenticated: bad MAC")
        now = time.time()
        if abs(now - frame.ts_ms / 1000) > MAX_CLOCK_SKEW_S:
            raise PeerRefused(f"not authenticated: clocks differ by more than {MAX_CLOCK_SKEW_S:g} s")
        if not self._nonces.first_use(frame.nonce, frame.ts_ms / 1000 + MAX_CLOCK_SKEW_S, now):
            raise PeerRefused("not authenticated: replayed nonce")
        msg = decode(frame.body)
        if isinstance(msg, Sealed | Refused):
            raise PeerRefused("not authenticated: nested frame")
        return msg

    def seal_reply(self, request: Sealed, reply: Message) -> Sealed:
        body, ts_ms = encode(reply), int(time.time() * 1000)
        return Sealed(request.nonce, ts_ms, self._signer.sign(SERVER, _mac_fields(request.nonce, ts_ms, body)), body)

    def open_reply(self, request: Sealed, frame: Message) -> Message:
        """The reply inside the server's frame; raises PeerRefused when it is a refusal or not authentic."""
        if isinstance(frame, Refused):
            raise PeerRefused(frame.reason)
        if not isinstance(frame, Sealed) or frame.nonce != request.nonce:
            raise PeerRefused("the peer did not authenticate its reply (no deployment secret there?)")
        if not self._signer.verify(SERVER, _mac_fields(frame.nonce, frame.ts_ms, frame.body), frame.mac):
            raise PeerRefused("the peer's reply failed authentication (another deployment secret?)")
        return decode(frame.body)
