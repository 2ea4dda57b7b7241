"""A thin wrapper over one NIXL agent: the only file that imports nixl.

Not thread-safe (NIXL is not documented to be): after construction, only the transfer thread calls it.
NIXL's own progress thread is off (it busy-spins a core), so the caller must keep
calling check() on posted transfers and notifications() every <= 1 ms. Every NIXL exception is turned
into AgentError (PeerGone when NIXL reports the peer disconnected), never let through raw.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.transfer.base import KVCacheSpec

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """A NIXL call failed."""


class PeerGone(AgentError):
    """NIXL reported that the remote agent disconnected (its process died or removed us)."""


class StaleRequest(AgentError):
    """NIXL refused to post a prepared request made before the peer's agent was loaded again (postXferReq answers
    NOT_FOUND for such a stale handle): nothing was posted, and the same descriptors posted afresh may work."""


def _wrap(what: str, e: Exception) -> AgentError:
    cls = PeerGone if "Disconnect" in type(e).__name__ else AgentError
    return cls(f"{what}: {type(e).__name__}: {e}")


class XferState(enum.Enum):
    """A posted transfer's state, as NIXL names it."""

    PROC = "PROC"  # in progress
    DONE = "DONE"  # landed
    ERR = "ERR"  # failed or cancelled: nothing more lands


@dataclass
class Xfer:
    """One posted READ or WRITE."""

    handle: Any  # nixl_xfer_handle
    peer: str  # remote agent name
    num_bytes: int
    state: XferState
    num_descs: int = 0  # descriptor rows posted (one per contiguous run on both sides)
    post_seconds: float = 0.0  # time NIXL took to accept it (initialize_xfer + transfer): per-descriptor cost


@dataclass
class Prepared:
    """A READ or WRITE whose NIXL request exists but is not posted (NixlAgent.prepare): post_prepared() posts it,
    release() frees it; exactly one of the two, once."""

    handle: Any  # nixl_xfer_handle; None once posted or released
    op: str  # "READ" | "WRITE"
    peer: str  # remote agent name
    num_bytes: int
    num_descs: int  # descriptor rows

    def release(self) -> None:
        """Free the request (not posted: nothing can be in flight); idempotent, never raises."""
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                handle.release()
            except Exception as e:
                log.warning("releasing a prepared %s to %s: %s", self.op, self.peer, e)


class NixlAgent:
    def __init__(self, name: str, kv_cache: Any, spec: KVCacheSpec) -> None:
        """Create the agent (UCX, no progress thread) and register the KV cache buffer once (~0.4 s)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.memory = spec.memory
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._kv_cache = kv_cache  # keep the registered buffer alive as long as the agent
        region = [(spec.base_addr, spec.geometry.total_bytes, spec.device_id, "")]
        try:
            self._reg = self._agent.register_memory(region, spec.memory)
        except Exception as e:
            raise _wrap("register_memory", e) from None
        self.metadata: bytes = self._agent.get_agent_metadata()

    # ---- peers --------------------------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (8-14 ms); returns its agent name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _wrap("add_remote_agent", e) from None
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # already gone: nothing to undo
            log.debug("remove_remote_agent(%s): %s", name, e)

    # ---- transfers ----------------------------------------------------------------------------------------------
    def post(
        self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes = b"", remote_memory: str = ""
    ) -> Xfer:
        """Post a READ (remote -> local) or WRITE (local -> remote) of [n, 3] (addr, len, dev) descriptor rows;
        the notification, if any, reaches the peer after the data. remote_memory: the peer's "DRAM" | "VRAM"
        (default: ours; they differ when one side stages through host memory). Raises AgentError; then nothing
        is in flight."""
        started = time.perf_counter()
        xfer = self.post_prepared(self.prepare(op, local, remote, peer, remote_memory), notif)
        xfer.post_seconds = time.perf_counter() - started  # NIXL's whole acceptance: the request built, then posted
        return xfer

    def prepare(self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, remote_memory: str = "") -> Prepared:
        """Build NIXL's transfer request for post_prepared() later (descriptors checked and resolved now, off the
        post's path). The caller owns it: post_prepared() or Prepared.release(). Raises AgentError."""
        try:
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local, self.memory),
                self._agent.get_xfer_descs(remote, remote_memory or self.memory),
                peer,
            )
        except Exception as e:
            raise _wrap(f"initialize_xfer {op} to {peer}", e) from None
        return Prepared(handle, op, peer, int(local[:, 1].sum()) if len(local) else 0, len(local))

    def post_prepared(self, prepared: Prepared, notif: bytes = b"") -> Xfer:
        """Post a prepare()d request with its notification (known only now); the Xfer owns the handle from here.
        Raises AgentError (StaleRequest: made before the peer's agent was loaded again); then nothing is in flight
        and the request is released."""
        if prepared.handle is None:
            raise AgentError(f"post {prepared.op} to {prepared.peer}: the prepared request was released")
        handle, prepared.handle = prepared.handle, None
        started = time.perf_counter()
        try:
            state = self._agent.transfer(handle, notif)
        except Exception as e:
            self._release(handle)
            what = f"post {prepared.op} to {prepared.peer}"
            if type(e).__name__ == "nixlNotFoundError":  # the only NOT_FOUND a built request can meet at its post
                raise StaleRequest(f"{what}: the request predates the peer's agent: {e}") from None
            raise _wrap(what, e) from None
        if state == "ERR":
            self._release(handle)
            raise AgentError(f"post {prepared.op} to {prepared.peer}: NIXL returned ERR")
        seconds = time.perf_counter() - started
        return Xfer(handle, prepared.peer, prepared.num_bytes, XferState(state), prepared.num_descs, seconds)

    def check(self, xfer: Xfer) -> XferState:
        """Progress a posted transfer. The handle is released once not PROC.
        Raises PeerGone when NIXL says the peer disconnected (the transfer is then over)."""
        if xfer.state is not XferState.PROC:
            return xfer.state
        try:
            xfer.state = XferState(self._agent.check_xfer_state(xfer.handle))
        except Exception as e:
            xfer.state = XferState.ERR
            self._release(xfer.handle)
            err = _wrap(f"transfer to {xfer.peer}", e)
            if isinstance(err, PeerGone):
                raise err from None
            log.warning("%s", err)
            return XferState.ERR
        if xfer.state is not XferState.PROC:
            self._release(xfer.handle)
        return xfer.state

    def abort(self, xfer: Xfer) -> bool:
        """Try to cancel a transfer still in progress; True if nothing more can land."""
        if xfer.state is not XferState.PROC:
            return True
        if self._release(xfer.handle):
            xfer.state = XferState.ERR
            return True
        return False

    def _release(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception as e:  # still active and not cancellable: keep polling it
            log.debug("release of a transfer handle failed: %s", e)
            return False

    # ---- notifications ------------------------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise _wrap(f"send_notif to {peer}", e) from None

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message); also drives progress on the target side."""
        try:
            got = self._agent.get_new_notifs()
        except Exception as e:
            log.warning("%s", _wrap("get_new_notifs", e))
            return []
        out: list[tuple[str, bytes]] = []
        for peer, msgs in got.items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((name, m) for m in msgs)
        return out

    def close(self) -> None:
        """Deregister the KV cache and drop the agent (after the transfer thread has stopped)."""
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.warning("%s", _wrap("deregister_memory", e))
        self._agent = None
        self._kv_cache = None
