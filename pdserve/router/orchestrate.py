"""One client request split into a prefill leg and a decode leg, in pull or push mode (docs/architecture.md).

pull: P answers first (max_tokens=1, do_remote_decode) with its KV coordinates; D then gets the original
      body plus those coordinates, and D's answer (streamed or not) goes back to the client. P's params
      without do_remote_prefill (a push instance says why) are a 502 naming the prefill leg. The router
      checks P's params (decode_answer) but relays them to D verbatim, as vLLM's proxy does: a vLLM decode
      instance reads keys pdserve does not model (per-KV-group block lists, dcp_size, an expiry).
Both modes tell P the client's max_tokens (decode_max_tokens in P's kv_transfer_params): P refuses a prompt
that leaves no room for them with D's 400, before spending the prefill (a vLLM P ignores the key).
push: P and D are chosen at arrival and both legs leave at once with one fresh transfer_id; D's
      kv_transfer_params carry P's coordinates from P's GET /kv_transfer/info (cached per P URL). If P's leg
      fails, D's leg is cancelled and the client gets a 502 naming the prefill leg.

Or not split:
colocated: the whole request goes to one `--kv-role both` instance of the pool, chosen by the policy; its
      answer (streamed or not) goes back as is. A failure is a 502 naming the instance.
selective disaggregation (pull, push with `colocate_below`): a request whose estimated prompt
      (router/prompt_len.py) is shorter than `colocate_below` tokens goes whole to a decode instance, without
      kv_transfer_params, and D prefills it locally; P never sees it.

Both legs carry the client's X-Request-Id. A client that disconnects cancels the legs in flight: their
connections close, and each backend aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response

from pdserve.auth import DEFAULT_TTL_S
from pdserve.kv.capability import KVAuth
from pdserve.kv.decode import decode_answer
from pdserve.kv.params import (
    KVParamsError,
    Mode,
    PullSource,
    PushSource,
    Refusal,
    RemoteDecode,
    encode,
)
from pdserve.router.call import Call, prefill_body
from pdserve.router.health import HealthMonitor
from pdserve.router.policy import MODES, Backend, Lease, Pool
from pdserve.router.prefill_info import PrefillInfo, push_coordinates
from pdserve.router.prompt_len import estimate_prompt_tokens
from pdserve.router.relay import relay_stream
from pdserve.router.upstream import LegError, open_stream, post_json
from pdserve.web import ClientDisconnected, race_disconnect, until_disconnect

log = logging.getLogger(__name__)


class Orchestrator:
    """Runs calls in `mode` with one shared aiohttp session.

    pull/push: over the `prefill` and `decode` pools; colocated: `prefill` is None and `decode` is the pool of
    `--kv-role both` instances, each of which runs whole requests. `colocate_below` (pull/push only): prompts
    estimated shorter than this many tokens skip P and go whole to a decode instance; None = never.
    """

    def __init__(
        self,
        mode: str,
        prefill: Pool | None,
        decode: Pool,
        session: aiohttp.ClientSession,
        info_timeout_s: float = 10.0,
        colocate_below: int | None = None,
        kv_auth: KVAuth | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        if (prefill is None) != (mode == "colocated"):
            raise ValueError("pull and push need a prefill pool; colocated takes none")
        if colocate_below is not None and mode == "colocated":
            raise ValueError("colocate_below applies to pull and push only")
        self.mode = mode
        self._prefill = prefill
        self.decode = decode
        self.session = session
        self.kv_auth = kv_auth or KVAuth(None)  # signs push capabilities (kv/capability.py)
        self.colocate_below = colocate_below
        self.num_whole = 0  # calls sent whole to one instance so far (all of them in colocated mode)
        self.prefill_info = PrefillInfo(session, info_timeout_s)  # push: P URL -> its /kv_transfer/info
        self._background: set[asyncio.Task[Any]] = set()  # P legs still finishing after D answered
        self.monitor: HealthMonitor | None = None  # set by the app: re-checks before a refusal for health

    @property
    def prefill(self) -> Pool:
        assert self._prefill is not None, "colocated mode has no prefill pool"
        return self._prefill

    def is_short(self, body: dict[str, Any]) -> bool:
        """Whether a pull/push call skips P: its estimated prompt is below `colocate_below` tokens."""
        if self.colocate_below is None:
            return False
        num_tokens = estimate_prompt_tokens(body)
        return num_tokens is not None and num_tokens < self.colocate_below

    async def handle(self, call: Call) -> Response:
        """The client's answer; raises LegError or ClientDisconnected."""
        if self.mode == "colocated":
            return await self._whole(call, "instance")
        if self.is_short(call.body):
            return await self._whole(call, "decode")
        return await (self._pull(call) if self.mode == "pull" else self._push(call))

    # --- whole requests (colocated, or short prompts in pull/push) ---------------------------------------

    async def _whole(self, call: Call, leg: str) -> Response:
        """Send the client's body, without kv_transfer_params, to one instance of the decode pool; `leg`
        ("instance" or "decode") names it in errors."""
        call.is_whole = True
        self.num_whole += 1
        d = self.decode.choose()
        call.decode_url = d.url
        body = {k: v for k, v in call.body.items() if k != "kv_transfer_params"}
        if not call.is_stream:
            with self.decode.lease(d):
                answer = await race_disconnect(
                    post_json(self.session, leg, d.url, call.path, body, call.headers), call.http
                )
            return JSONResponse(answer, headers=call.headers)
        lease = self.decode.lease(d)
        try:
            resp = await race_disconnect(
                open_stream(self.session, leg, d.url, call.path, body, call.headers), call.http
            )
        except BaseException:
            lease.release()
            raise
        return relay_stream(call, resp, lease, [], leg)

    # --- pull -------------------------------------------------------------------------------------------

    async def _pull(self, call: Call) -> Response:
        if not self.decode.has_healthy() and self.monitor is not None:
            await self.monitor.check_pool(self.decode)  # the marks may be up to one interval old
        if not self.decode.has_healthy():  # refuse before P spends a prefill (and pins blocks) for nothing
            urls = ", ".join(b.url for b in self.decode.backends)
            message = f"no healthy decode instance ({urls}); retry later"
            raise LegError("decode", urls, message, status=503, retry_after="1")
        p = self.prefill.choose()
        call.prefill_url = p.url
        with self.prefill.lease(p):
            body = prefill_body(call.body, encode(RemoteDecode(None, None, None, call.max_tokens)))
            answer = await race_disconnect(
                post_json(self.session, "prefill", p.url, call.path, body, call.headers), call.http
            )
        raw = answer.get("kv_transfer_params")
        try:
            kv = decode_answer(raw)
        except KVParamsError as e:
            raise LegError("prefill", p.url, f"prefill instance {p.url} answered malformed params: {e}") from e
        if kv is not None and not isinstance(kv, PullSource):  # P could not hand over (a push P)
            reason = kv.error if isinstance(kv, Refusal) else raw
            raise LegError(
                "prefill",
                p.url,
                f"prefill instance {p.url} did not hand over its KV ({reason}); "
                "this router runs in pull mode: start the instances with --kv-transfer pull",
            )
        if kv is None:
            log.warning(
                "request %s: prefill %s returned no kv_transfer_params; decode will prefill", call.request_id, p.url
            )
        d = self.decode.choose()
        call.decode_url = d.url
        d_body = {**call.body, "kv_transfer_params": None if kv is None else raw}  # verbatim: see the docstring
        try:
            if not call.is_stream:
                with self.decode.lease(d):
                    answer = await race_disconnect(
                        post_json(self.session, "decode", d.url, call.path, d_body, call.headers), call.http
                    )
                return JSONResponse(answer, headers=call.headers)
            d_lease = self.decode.lease(d)
            try:
                resp = await race_disconnect(
                    open_stream(self.session, "decode", d.url, call.path, d_body, call.headers), call.http
                )
            except BaseException:
                d_lease.release()
                raise
        except BaseException:  # D never took the KV (down, refused, client gone): P's pin is freed now
            if isinstance(kv, PullSource):
                self._release_on(p.url, {"request_id": kv.request_id, "kv_transfer_params": raw}, call)
            raise
        return relay_stream(call, resp, d_lease, [], "decode")

    # --- push -------------------------------------------------------------------------------------------

    async def _push(self, call: Call) -> Response:
        p, d = self.prefill.choose(), self.decode.choose()
        call.prefill_url, call.decode_url = p.url, d.url
        info = await race_disconnect(self.prefill_info.get(p.url), call.http)
        try:
            return await self._push_legs(call, p, d, info)
        except LegError as e:
            first = e
        # the legs carried P's cached coordinates (engine id, side channel), signed: if P restarted since they
        # were fetched, P refuses them (403) or D cannot reach them. A failed call dropped them: fetch them again
        # and retry once on new ones. A stale route is never the client's error (no 403 reaches it for one).
        fresh = await race_disconnect(self.prefill_info.get(p.url), call.http)
        if push_coordinates(fresh) == push_coordinates(info):
            if first.leg == "prefill" and first.status == 403:  # the router signed what P holds: another secret
                raise LegError(
                    "prefill",
                    p.url,
                    f"prefill instance {p.url} refused the router's push capability ({first}); start the router "
                    "with the instances' --kv-auth-secret",
                ) from first
            raise first
        log.info(
            "request %s: prefill %s has new coordinates (engine id %s -> %s: it restarted); retrying once",
            call.request_id, p.url, info.get("engine_id"), fresh.get("engine_id"),
        )  # fmt: skip
        try:
            return await self._push_legs(call, p, d, fresh)
        except LegError as e:
            if e.leg == "prefill" and e.status == 403:
                raise LegError(
                    "prefill", p.url, f"prefill instance {p.url} changed its coordinates again during this request "
                    "(restarting?); retry later", status=503, retry_after="1",
                ) from e  # fmt: skip
            raise

    async def _push_legs(self, call: Call, p: Backend, d: Backend, info: dict[str, Any]) -> Response:
        """Both legs of a push call with P's coordinates `info`."""
        transfer_id = uuid.uuid4().hex
        host, port, engine_id = info["side_channel_host"], info["side_channel_port"], info["engine_id"]
        cap = self.kv_auth.issue_push(transfer_id, engine_id, host, port, DEFAULT_TTL_S)  # both legs carry it
        p_body = prefill_body(call.body, encode(RemoteDecode(Mode.PUSH, transfer_id, cap, call.max_tokens)))
        source = PushSource(transfer_id, host, port, engine_id, info.get("tp_size", 1), cap)
        d_body = {**call.body, "kv_transfer_params": encode(source)}
        p_task = asyncio.create_task(self._leased(self.prefill.lease(p), p_body, call, "prefill"))
        d_lease = self.decode.lease(d)
        opener = open_stream if call.is_stream else post_json
        d_task: asyncio.Task[Any] = asyncio.create_task(
            opener(self.session, "decode", d.url, call.path, d_body, call.headers)
        )
        watch = asyncio.create_task(until_disconnect(call.http))
        succeeded = False
        try:
            waiting: set[asyncio.Future[Any]] = {p_task, d_task, watch}
            while not d_task.done():
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    raise ClientDisconnected()
                if p_task in done:
                    waiting.discard(p_task)
                    p_task.result()  # raises the prefill leg's LegError; D's leg is cancelled below
            result = d_task.result()  # raises the decode leg's LegError; P's leg is cancelled below
            succeeded = True
        finally:
            watch.cancel()
            if not succeeded:
                d_lease.release()
                self.prefill_info.forget(p.url)  # P may have restarted with new coordinates
                # P may hold the prefill pinned; the P leg's params carry the capability the release needs
                self._release_on(
                    p.url, {"transfer_id": transfer_id, "kv_transfer_params": p_body["kv_transfer_params"]}, call
                )
                for t in (p_task, d_task):
                    t.cancel()
                results = await asyncio.gather(p_task, d_task, return_exceptions=True)
                if isinstance(results[1], aiohttp.ClientResponse):  # D's stream opened as P failed
                    results[1].close()
        self._finish_in_background(p_task, call)
        if not call.is_stream:
            d_lease.release()
            return JSONResponse(result, headers=call.headers)
        return relay_stream(call, result, d_lease, [p_task], "decode")

    async def _leased(self, lease: Lease, body: dict[str, Any], call: Call, leg: str) -> dict[str, Any]:
        with lease:
            return await post_json(self.session, leg, lease.backend.url, call.path, body, call.headers)

    def _release_on(self, p_url: str, which: dict[str, Any], call: Call) -> None:
        """Tell P, in the background, to free the KV it pinned for a decode leg that will never take it
        (POST /kv_transfer/release with the request's id and capability; 404 = already gone, which is fine; 403 =
        P never accepted that capability, a restarted P: nothing of it is pinned)."""
        name = {k: v for k, v in which.items() if k != "kv_transfer_params"}

        async def release() -> None:
            try:
                await post_json(self.session, "prefill", p_url, "/kv_transfer/release", which, call.headers)
            except LegError as e:
                if e.status == 403:
                    log.info("request %s: %s refused the release of %s: %s", call.request_id, p_url, name, e)
                elif e.status != 404:
                    log.warning("request %s: releasing %s on %s failed: %s", call.request_id, name, p_url, e)

        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish_in_background(self, task: asyncio.Task[Any], call: Call) -> None:
        """Let a P leg that is still answering finish on its own, logging a failure."""

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("request %s: prefill leg failed after decode answered: %s", call.request_id, t.exception())

        if task.done():
            done(task)
        else:
            self._background.add(task)
            task.add_done_callback(done)
