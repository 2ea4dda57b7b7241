"""KV-cache transfer between a prefill (P) and a decode (D) instance over NIXL, in pull or push mode.

Entry point: `factory.make_connectors(cfg, block_size) -> (ConnectorScheduler, ConnectorWorker)`; the
contract is base.py; kv_transfer_params, capabilities and KV groups are pdserve.kv's. This package never
imports the engine, the server or the model.

Files, laid out by thread. Shared and pure (no torch, numpy or nixl):
  base.py            the contract: KVCacheSpec (kv.geometry's CacheGeometry + where the cache is + whose),
                     RecvTask, SendTask, StepMeta, TransferResults, the two ABCs
  layout.py          block ids + token range -> merged byte regions of two caches (each a CacheGeometry and a
                     base address), block-size translation, head slices (pure math)
  wire.py            the wire codec (WIRE_VERSION, encode/decode, field checks) and the side channel's frames;
                     wire_notifs.py: the NIXL notifications (pull release/ack, push register/done/cancel/fail);
                     wire_compat.py: whether two handshakes can exchange KV (compatibility hash, refusal)
  faults.py          test-only Faults (delays, switches) and its one defer() helper; NO_FAULTS in production
  factory.py         make_connectors(): Nop for kv role "both", else pull or push (binds the side channel)
  nop.py             both halves for kv role "both"
  heads.py           tensor parallelism: which rank holds which KV heads, which P rank sends which D rank what
  ranks.py           tensor parallelism: StepMeta to the other ranks' workers, their results back (msgpack),
                     RankMerger (one result per request: a recv finishes when every rank's part landed)
scheduler/ — the engine thread's halves (pure Python; tests/unit/test_layers.py checks it):
  base.py            what pull's and push's scheduler halves share: RecvTasks, StepMeta, P's answers
  pull.py / push.py  PullScheduler / PushScheduler
thread/ — the transfer thread (and the side-channel thread):
  loop.py            TransferLoop: the transfer thread itself; owns the agent, runs commands, timers and polling
  worker.py          NixlWorker: the ConnectorWorker both modes share; the side-channel request handler
  context.py         TransferContext (what a mode's core works with) and the ModeCore protocol
  pull.py            PullCore (D's READs) and PullWorker; pull_pins.py: P's pins and leases (PinKeeper);
                     pull_read.py: one pull's state (Read) and its READs; pull_confirm.py: D's deadline for P's acks
  push.py            PushCore (routes to push_send.py, P's rendezvous, and push_recv.py, D's registration and
                     completions) and PushWorker; push_dests.py: the rendezvous as D's ranks see it (their
                     registrations, cancels, keepalives; how it ends); push_rendezvous.py: its state (per transfer id,
                     per D rank); push_write.py: one D rank's WRITE (descriptors, post, poll); push_wait.py:
                     one push recv's state on D (Wait)
  landing.py         D, both modes: what happens once a recv's KV landed (staging copy-in, then report)
  agent.py           the only file that imports nixl; errors become AgentError / PeerGone
  netdev.py          UCX_NET_DEVICES before the agent exists: UCX listens on the side channel's interface only
  handshake.py       the side channel: TCP + msgpack frames, one asyncio thread, server and client; with a
                     secret, Sealed frames (HMAC both ways) and a Refused that reveals nothing
  peers.py           handshake cache per address, loaded remote agents, liveness probes
  results.py         thread-safe hand-back of results, events and counters to the engine
Kept at the top (torch, not the transfer thread's own):
  staging.py         kv_buffer_device "cpu": a pinned host mirror NIXL moves instead of a CUDA cache, block-id
                     copies on a dedicated stream (P: before D can read / before the WRITE; D: before finished)

Threads per instance: the engine thread (scheduler half; worker's submit/poll_results), the transfer
thread (every NIXL call), the side-channel thread (handshakes). Start: transfer thread, side channel;
shutdown: side channel, transfer thread (in-flight transfers drain up to 2 s), agent.

Pull: P finishes -> blocks pinned, response carries P's coordinates -> router -> D allocates, handshakes with
P (cached per address), READs tokens [num_local, num_prompt - 1), sends PullRelease; P answers PullReleaseAck
(held: the pin was in place) and reports finished_sends (or "expired" after lease_s); D reports finished_recvs
only on held=True. D's READ carries no notification: one
that carries or follows a notification completes only when P polls (~1 ms vs ~30 us measured here).

Push: D allocates at arrival, handshakes (P loads D's agent), sends PushRegister(transfer_id, attempt, blocks)
from its transfer thread. P's rendezvous pairs it with the finished prefill in either order; the second to
arrive triggers one WRITE carrying PushDone; P reports finished_sends when the WRITE is over; D reports
finished_recvs once every producer rank's PushDone arrived. Only the newest attempt of a transfer id is written.
With TP, each D rank registers with every P rank, whose rendezvous keeps one part per D rank (its registration,
WRITE, cancel, keepalive); P frees its blocks when every D rank's part is over.
P's scheduler half announces each arriving request's transfer id (StepMeta.expected) and those that end
without a prefill (StepMeta.abandoned): while P has the prefill queued or running it keeps D's registration
and answers it with PushQueued (then every keepalive_ms), which restarts D's receive clock; an abandoned
transfer's registration gets PushFail at once. Only a registration P knows nothing about times out.

Staging (kv_buffer_device "cpu", CUDA cache): NIXL registers a host mirror. Invariant: the mirror holds a
block's data before any peer can read it (pull: copied in submit() on the engine thread, before the step's
outputs leave; push: copied before the WRITE is posted), and D's cache is written only by the copy-in that
precedes finished_recvs. See staging.py.

Who frees which block when (nothing is freed while a READ/WRITE may still land in it):
  P pinned (pull):  D's PullRelease (matching block ids), lease_s expiry ("expired"), the engine's release
                    (StepMeta.releases: abort, POST /kv_transfer/release).
  P pinned (push):  the WRITE is DONE/failed; lease_s without a registration ("expired"); the engine's release.
  D (pull):         READ done/failed, handshake failed, recv_timeout_s before the READ (a posted READ is
                    cancelled through NIXL or waited for).
  D (push):         all PushDone (finished); PushFail (P gave up: registration timeout, prefill aborted on P, bad
                    request, write error);
                    after a timeout/abort: P's PushCancelAck, or P known dead (NIXL disconnect, or its side
                    channel refuses / answers with another agent).
"""
