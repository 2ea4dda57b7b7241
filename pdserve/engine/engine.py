"""LLMEngine: the step loop that ties scheduler, worker and KV connector together (single thread).

Starting the TP ranks, rank 0's model and KV cache is tp/rank_zero.py; the bookkeeping other threads and repeated
calls read is timelines.py (GET /timeline) and released_pins.py (a repeated release); the limits a request is
checked against are limits.py, the /metrics snapshot stats.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.client import EngineStats
from pdserve.engine.kv_cache import kv_cache_spec
from pdserve.engine.kv_landed import take_landed
from pdserve.engine.limits import RequestLimits
from pdserve.engine.outputs import RequestOutput, take_output
from pdserve.engine.released_pins import ReleasedPins
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.stats import StepCounters, engine_stats
from pdserve.engine.text import TextTracker
from pdserve.engine.timelines import Timelines
from pdserve.engine.tp.group import TPGroup, TPGroupError
from pdserve.engine.tp.rank_zero import start_rank_zero
from pdserve.engine.tp.transfer import TPWorker
from pdserve.kv.params import KVTransferParams, PullSource, PushSource, RemoteDecode
from pdserve.prompt_pack import TokenArray
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.factory import make_connectors
from pdserve.transfer.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, wakeup: Callable[[], None] = lambda: None, faults: Faults = NO_FAULTS
    ) -> None:
        """faults: a test's transfer faults (transfer/faults.py), handed to every rank's connector factory."""
        self.config = config
        tp = config.parallel.tensor_parallel_size
        # the TP ranks, ready (joined in shutdown()), rank 0's model and cache
        started = start_rank_zero(config, faults)
        self.ranks: TPGroup | None = started.ranks
        loaded, kv_cache, device = started.compute.loaded, started.compute.kv_cache, started.compute.device
        self.num_blocks = started.compute.num_blocks
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.arch.vocab_size
        tok = loaded.tokenizer
        self.eos_token_ids = tuple(tok.eos_token_ids if tok else loaded.arch.eos_token_ids)
        block_size = config.cache.block_size
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, block_size, self.num_blocks)  # fixed
        side_ports = self.ranks.side_ports if self.ranks is not None else ()
        self.kv_scheduler, self.kv_worker = make_connectors(
            config.transfer, block_size, tp, side_ports, loaded.decoder.kv_groups, faults
        )
        if self.ranks is not None and config.transfer.is_disaggregated:
            self.kv_worker = TPWorker(self.kv_worker, self.ranks)  # every rank moves its own KV slice
        self.pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            config.scheduler, self.pool, block_size, self.max_model_len, self.kv_scheduler, loaded.decoder.kv_groups,
            cache_received_kv=config.transfer.auth_secret is not None,  # only KV proven to be of its prompt (issue 26)
        )  # fmt: skip
        use_graphs = not config.model.enforce_eager
        self.runner = ModelRunner(loaded.decoder, kv_cache, device, use_graphs, self.ranks, self.max_model_len)
        ports = tuple(self.kv_scheduler.info().get("side_channel_ports", ())) if tp > 1 else ()
        spec = kv_cache_spec(
            kv_cache, loaded.name, config.model.dtype, 0, tp, loaded.arch.num_kv_heads, ports, loaded.decoder.kv_groups
        )
        self.kv_worker.register_kv_cache(kv_cache, spec)
        self.kv_worker.start(wakeup)  # joined in shutdown()
        self._text: dict[str, TextTracker] = {}
        self._timelines = Timelines()  # GET /timeline reads a snapshot from the server's thread
        self.ttft_seconds: deque[float] = deque()  # new observations; popped (thread-safe) by the metrics reader
        self.transfer_seconds: deque[float] = deque()  # likewise, moved here from the connector by stats()
        self.transfer_posts: deque[tuple[int, float]] = deque()  # (descriptors, post seconds), likewise
        self.num_steps = 0  # step() calls so far
        self.num_step_failures = 0  # steps whose forward pass raised (their requests failed)
        self.transfer_hook_seconds = 0.0  # engine-thread time spent in the connector hooks (cumulative)
        self._released = ReleasedPins()  # P: pins given up by abort()/release() (a repeat answers found)

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: Sequence[int] | TokenArray, params: SamplingParams, kv: KVTransferParams | None = None
    ) -> None:
        """Raise ValueError with a user-facing message for input the engine cannot serve (limits.py; any thread)."""
        self.limits.check(prompt_token_ids, kv)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        client_request_id: str | None = None,
        validated: bool = False,
    ) -> None:
        """Raises ValueError (KVParamsError for params the connector cannot serve) before anything is queued.
        `validated`: the caller checked these ids with validate() (the limits are fixed; AsyncEngine does it on
        the event loop), so the vocabulary is not checked twice on the first token's path."""
        if not validated:
            self.validate(prompt_token_ids, params, kv_transfer_params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, kv_transfer_params)
        req.mark("arrival")
        self.scheduler.add(req)
        self._timelines.add(request_id, client_request_id, self.config.transfer.role, req.timeline)
        self._text[request_id] = TextTracker(self.tokenizer, params.stop, req.prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; one that finished and is pinned for a consumer (P) has its pin released now."""
        req = self.scheduler.abort(request_id)
        if req is None and (pinned := self.scheduler.release_pin(request_id)) is not None:
            self._released.remember(pinned)
        self._submit_transfers()  # now, not at the next step: an idle P may not take one soon
        return None if req is None else self._output(req)

    def abort_if_queued(self, request_id: str) -> RequestOutput | None:
        """Abort a request still waiting for its first step (its queue wait ran out): its output, or None when it
        has started (it then runs to its end) or is unknown."""
        req = self.scheduler.abort_if_queued(request_id)
        if req is None:
            return None
        self._submit_transfers()  # push: P tells D's registration at once that this transfer is abandoned
        return self._output(req)

    def refuse_transfer(self, source: PullSource | PushSource) -> None:
        """D: a request carrying these coordinates was refused before the engine had it: its producer frees the
        KV now (the worker tells it; nothing comes back)."""
        self.kv_scheduler.on_refused(source)
        self._submit_transfers()  # now: an idle D may not step soon

    def release(self, request_id: str | None, transfer_id: str | None) -> tuple[bool, RequestOutput | None]:
        """P: give up a request's pinned KV now (D's leg failed): (known, the aborted request's output if it was
        still running). Exactly one id is given; push names the transfer id. Only a prefill leg (RemoteDecode
        params) is released: any other running request (a decode, a whole request) is unknown here."""
        live = [*self.scheduler.pinned.values(), *self.scheduler.requests.values()]
        rid = request_id if request_id is not None else self._released.producer_of(transfer_id, live)
        if rid is None:
            return False, None
        if (req := self.scheduler.requests.get(rid)) is not None:
            if not isinstance(req.kv_transfer_params, RemoteDecode):  # only a prefill leg is a producer's to give up
                return False, None
            out = self.abort(rid)
            if out is not None:
                out.released = True  # the router gave this leg up: its HTTP answer is a 499, not an error
            return True, out
        if (pinned := self.scheduler.release_pin(rid)) is not None:
            self._released.remember(pinned)
            self._submit_transfers()
            return True, None
        return rid in self._released, None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def has_transfers(self) -> bool:
        s = self.scheduler
        return bool(s.waiting_for_kv or s.pinned or s.aborting)

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One step; returns its outputs. emit: takes those ready before the forward pass (KV landed with D's first
        token, failed recvs), so they reach their clients without waiting for it; else they are returned too."""
        self.num_steps += 1
        outputs = self._apply_transfer_results()
        if emit is not None and outputs:
            emit(outputs)
            outputs = []
        batch = self.scheduler.schedule()
        outputs += [self._finish(req, "length") for req in batch.out_of_blocks]
        self._submit_transfers()  # D: registrations/reads for requests parked just now
        for c in batch.chunks:
            self.scheduler.requests[c.request_id].mark("prefill_start")
        try:
            sampled = self.runner.execute(batch.chunks) if batch.chunks else {}
        except TPGroupError:  # a rank is gone: no step can run any more; the caller fails every request
            raise
        except Exception as e:  # a failed forward pass fails the requests in it, never the loop
            return outputs + self._fail_batch(batch, e)
        stopped = self.scheduler.update(batch, sampled)
        outputs += self._postprocess(sampled, stopped)
        self._submit_transfers()  # P: finished prefills ready to be sent
        return outputs

    def _fail_batch(self, batch: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        self.num_step_failures += 1
        log.exception("engine step failed; failing its %d requests", len(batch.chunks), exc_info=error)
        message = f"engine step failed: {type(error).__name__}: {error}"
        outputs = []
        for c in batch.chunks:
            req = self.scheduler.requests.get(c.request_id)
            if req is not None and not req.is_finished:
                outputs.append(self._finish(req, "error", message))
        self._submit_transfers()
        return outputs

    def _submit_transfers(self) -> None:
        started = time.perf_counter()
        meta = self.kv_scheduler.build_step_meta()
        if meta:
            self.kv_worker.submit(meta)
        self.transfer_hook_seconds += time.perf_counter() - started

    def _apply_transfer_results(self) -> list[RequestOutput]:
        started = time.perf_counter()  # both hooks add to transfer_hook_seconds: O(1) per step
        try:
            return self._take_transfer_results()
        finally:
            self.transfer_hook_seconds += time.perf_counter() - started

    def _take_transfer_results(self) -> list[RequestOutput]:
        res = self.kv_worker.poll_results()
        if not res:
            return []
        for rid, event, t in res.events:
            self._timelines.record(rid, event, t)
        firsts = take_landed(self.scheduler, res, self.vocab_size)  # D: KV landed, some with their first token
        stopped = [r for r in firsts if r.finish_reason is not None]
        outputs = self._postprocess({r.request_id: r.output_token_ids[-1] for r in firsts}, stopped)
        recompute = self.config.transfer.load_failure_policy == "recompute"
        refused = set(res.refused_recvs)  # the producer holds no KV under these coordinates: the request's error
        for rid, reason in res.failed_recvs:
            req = self.scheduler.on_kv_failed(rid, recompute)
            if req is not None:
                self.scheduler.finish(req, "error", f"KV transfer failed: {reason}")
                outputs.append(self._output(req))
                outputs[-1].client_error = rid in refused
        for rid in res.cancelled_recvs:
            self.scheduler.on_recv_cancelled(rid)
        for rid in res.finished_sends:
            self.scheduler.on_send_finished(rid)
        return outputs

    def _postprocess(self, sampled: dict[str, int], stopped: list) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        stopped_ids = {r.request_id for r in stopped}
        for rid in sampled:
            req = self.scheduler.requests[rid]
            if len(req.output_token_ids) == 1:
                req.mark("first_token")
                self.ttft_seconds.append(now - req.arrival_time)
            text = self._text[rid]
            if text.add(req.output_token_ids[-1]) and rid not in stopped_ids:
                req.finish_reason = "stop"  # a stop string appeared
                stopped.append(req)
        outputs += [self._finish(req, req.finish_reason or "stop") for req in stopped]
        outputs += [self._output(self.scheduler.requests[rid]) for rid in sampled if rid in self.scheduler.requests]
        return outputs

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(req, reason, error)
        req.mark("finished")
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        text = self._text.pop(req.request_id) if finished else self._text[req.request_id]
        return take_output(
            req, text.visible(finished), self.kv_scheduler.take_answer(req.request_id) if finished else None
        )

    # ---- introspection --------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of this engine (engine thread only: it reads the scheduler and drains the connector)."""
        t = self.kv_worker.stats()
        self.transfer_seconds.extend(t.transfer_seconds)
        self.transfer_posts.extend(t.posts)
        steps = StepCounters(self.num_steps, self.num_step_failures, self.transfer_hook_seconds)
        return engine_stats(self.scheduler, self.pool, self.num_blocks, steps, t)

    def timelines(self) -> list[dict[str, Any]]:
        """A copy of recent timelines; safe to call from another thread (timelines.py)."""
        return self._timelines.snapshot()

    def shutdown(self) -> None:
        self.kv_worker.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()
