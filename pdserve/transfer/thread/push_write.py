"""Push, prefill side: one D rank's WRITE, from its registration to DONE or ERR, and P's notifications to D.

post_write checks a registration against D's handshake and the prefill, takes the WRITE laid out before the
prefill ended (push_prepare.py: descriptors of the heads that D rank takes from this P rank, NIXL's request) or
lays it out now, stages the blocks out when there is a host mirror, and posts one WRITE carrying a PushDone;
check_write polls it. Both only say how the WRITE ended (WriteOver, or None while it
is in flight): what that means for the transfer (refusals, freeing P's blocks) is push_send.SendSide's to
decide. Kept apart so the byte-moving half can be read, and changed, without the rendezvous' bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.transfer.base import SendTask
from pdserve.transfer.heads import num_producers
from pdserve.transfer.layout import LayoutError
from pdserve.transfer.thread.agent import AgentError, PeerGone, StaleRequest, XferState
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.kv_verify import producer_sums
from pdserve.transfer.thread.push_prepare import PreparedWrite, lay_out
from pdserve.transfer.thread.push_rendezvous import DestPart
from pdserve.transfer.wire import Message, encode
from pdserve.transfer.wire_notifs import PushDone

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOver:
    """How one D rank's WRITE ended: nothing more can land in that rank's blocks."""

    ok: bool  # written (or nothing to write: zero tokens, or this P rank holds none of its heads)
    error: str | None  # why not, when not ok


def post_write(
    ctx: TransferContext, transfer_id: str, send: SendTask, x: DestPart, d_rank: int,
    prepared: PreparedWrite | None = None,
) -> WriteOver | None:  # fmt: skip
    """Post the WRITE of x.write_reg (D rank d_rank's registration being written) from send's blocks, setting
    x.xfer, x.posted_at and x.silent; None while the WRITE is in flight (check_write polls it). prepared: that
    registration's WRITE laid out before the prefill ended (push_prepare.py), used when it still fits the
    finished prefill's blocks and released otherwise."""
    reg = x.write_reg
    assert reg is not None
    msg, peer = reg.msg, reg.peer
    if prepared is not None and not prepared.fits(send.num_tokens, send.tables, ctx.geometry.block_size):
        log.info("push %s: the prefill's blocks changed since its WRITE was prepared; laid out again", transfer_id)
        prepared.release()
        prepared = None
    try:
        if msg.start_token + msg.num_tokens > send.num_tokens:
            raise LayoutError(
                f"the prefill has KV for {send.num_tokens} tokens, D asked up to {msg.start_token + msg.num_tokens}"
            )
        # the hand-over's parts (bench/phases.py splits it): laid out here, or before the prefill ended
        layout = prepared.layout if prepared is not None else lay_out(ctx, send.tables, msg, peer, _marker(ctx, send))
    except LayoutError as e:
        return WriteOver(False, f"cannot write: {e}")
    request = prepared.take() if prepared is not None else None  # NIXL's request, ours to post or free now
    if layout.heads is None:  # D's rank gets its heads from other ranks of P: this rank's part is over, unannounced
        x.silent = True
        return WriteOver(True, None)
    n_prod = num_producers(ctx.geometry.total_kv_heads, ctx.spec.tp_size, peer.info.tp_size, d_rank)
    # D's first output token, when D asked for the KV up to where the prefill's ends (kv.params.hands_first_token)
    ends_there = msg.start_token + msg.num_tokens == send.num_tokens
    first = send.first_token_id if ends_there and send.first_token_id is not None else -1
    done = PushDone(transfer_id, msg.attempt, ctx.spec.tp_rank, n_prod, layout.num_bytes, first_token_id=first)
    x.posted_at, posted_wall = time.monotonic(), time.time()  # the post may complete the WRITE
    try:
        if msg.num_tokens == 0:
            ctx.agent.send_notif(peer.agent_name, encode(done))
        else:
            if ctx.stager is not None:  # KV cache -> host mirror, exactly the blocks this WRITE reads
                for table, (first_tok, end) in zip(send.tables, layout.ranges, strict=True):
                    ctx.stager.stage_out(table, first_tok, end - first_tok)
            if ctx.checksum is not None:  # over what the WRITE reads (the mirror when staged): kv_verify.py
                done = replace(done, checksum=producer_sums(ctx, send.tables, list(layout.ranges), layout.heads))
            xfer = None
            if request is not None:
                try:
                    xfer = ctx.post_prepared(request, encode(done))  # (released if it raises)
                except StaleRequest as e:  # made before D's agent was loaded again: once more (any other: failed)
                    log.info("push %s: the prepared WRITE was refused (%s); posting it from its rows", transfer_id, e)
            if xfer is None:
                xfer = ctx.post("WRITE", layout.local, layout.remote, peer.agent_name, encode(done), peer.info.memory)
            x.xfer = xfer
    except (AgentError, RuntimeError) as e:
        if request is not None:
            request.release()  # (not posted: nothing in flight)
        if isinstance(e, PeerGone):
            ctx.peers.forget(peer)
        return WriteOver(False, f"WRITE to {peer.engine_id} rank {d_rank} not posted: {e}")
    ctx.sink.event(send.request_id, "transfer_posted", posted_wall)
    ctx.sink.event(send.request_id, f"write.p{ctx.spec.tp_rank}.r{d_rank}", posted_wall)  # one per (P rank, D rank)
    if x.xfer is not None:
        ctx.sink.posted(x.xfer.num_descs, x.xfer.post_seconds)
    return check_write(ctx, x, d_rank)


def _marker(ctx: TransferContext, send: SendTask) -> Callable[[str], None]:
    return lambda name: ctx.sink.event(send.request_id, name)


def check_write(ctx: TransferContext, x: DestPart, d_rank: int) -> WriteOver | None:
    """Poll D rank d_rank's WRITE (x.xfer); None while it is in flight."""
    if x.xfer is None:  # zero tokens: the notification was the whole transfer
        return WriteOver(True, None)
    assert x.write_reg is not None
    peer = x.write_reg.peer
    try:
        state = ctx.agent.check(x.xfer)
    except PeerGone as e:
        ctx.peers.forget(peer)
        return WriteOver(False, f"decode instance {peer.engine_id} rank {d_rank} went away: {e}")
    if state is XferState.DONE:
        return WriteOver(True, None)
    if state is XferState.ERR:
        return WriteOver(False, f"WRITE to {peer.engine_id} rank {d_rank} failed")
    return None


def notify(ctx: TransferContext, agent_name: str, msg: Message) -> None:
    """Send one notification to a D rank's agent, unless that peer is forgotten (dead); never raises."""
    if ctx.peers.by_agent(agent_name) is None:
        return  # forgotten (dead): nothing to tell
    try:
        ctx.agent.send_notif(agent_name, encode(msg))
    except AgentError as e:
        log.warning("push: could not send %s to %s: %s", type(msg).__name__, agent_name, e)
