"""D's transfer thread: the KV of a request D refused before admitting it goes back to its producer at once.

A request refused at D's edge (a capability for another prompt, a 400, a 503 admission refusal) or by D's
engine before it was allocated never gets a RecvTask, so nothing would tell P: P's pinned blocks (pull) or its
finished prefill (push) would wait for the lease. StepMeta.refusals carries such a request's coordinates here
(the server checked any capability first: with a deployment secret only a MAC-valid one comes this far), and
this rank tells every rank of P, after the usual (cached) handshake, which proves this instance holds the
deployment secret where one is set:
- pull: PullRelease(ok=False) naming P's request and exactly its pinned blocks, as D sends after a failed READ;
  P frees the pin once every D rank released it (each rank of D gets the same StepMeta) and does not answer;
- push: PushCancel for attempt REFUSED (D never registered): P gives the transfer up, freeing the finished
  prefill at once or, still running, as soon as it is handed over (push_send.py).
Best effort: a producer that cannot be reached frees the KV at its lease as before. No result is reported.
"""

from __future__ import annotations

import logging

from pdserve.kv.params import PullSource, PushSource
from pdserve.transfer.thread.agent import AgentError, PeerGone
from pdserve.transfer.thread.context import TransferContext
from pdserve.transfer.thread.peers import Peer
from pdserve.transfer.wire import Message, encode
from pdserve.transfer.wire_notifs import PullRelease, PushCancel

log = logging.getLogger(__name__)

REFUSED = -1  # PushCancel.attempt of a request D refused before registering any attempt


def give_back(ctx: TransferContext, source: PullSource | PushSource) -> None:
    """Tell every rank of the producer `source` names that this rank will never take that KV (transfer thread)."""
    if isinstance(source, PullSource) != (ctx.cfg.mode == "pull"):
        log.info("refused request's params are for the other mode; its producer's lease frees the KV")
        return
    if isinstance(source, PullSource):
        msg: Message = PullRelease(request_id=source.request_id, ok=False, num_bytes=0,
                                   block_ids=list(source.block_ids))  # fmt: skip
        what = f"request {source.request_id}"
    else:
        msg, what = PushCancel(transfer_id=source.transfer_id, attempt=REFUSED), f"transfer {source.transfer_id}"

    def send(peers: dict[int, Peer] | None, error: str | None) -> None:
        if peers is None:
            log.warning("refused %s: producer %s:%d not told (%s); its lease frees the KV", what, source.host,
                        source.port, error)  # fmt: skip
            return
        for p_rank, peer in peers.items():
            try:
                ctx.agent.send_notif(peer.agent_name, encode(msg))
            except AgentError as e:
                log.warning("refused %s: producer rank %d not told: %s", what, p_rank, e)
                if isinstance(e, PeerGone):
                    ctx.peers.forget(peer)
        log.info("refused %s: told its producer %s (%d ranks) to free the KV", what, source.engine_id, len(peers))

    # load_me: P knows this agent (as for an admitted request), so it counts this rank among the pin's consumers
    ctx.peers.connect_ranks(source.host, source.port, source.engine_id, True, send)
