"""One client request split into a prefill leg and a decode leg, in pull or push mode (docs/architecture.md).

pull: P answers first (max_tokens=1, do_remote_decode) with its KV coordinates; D then gets the original
      body plus those coordinates, and D's answer (streamed or not) goes back to the client. P's params
      without do_remote_prefill (a push instance says why) are a 502 naming the prefill leg. The router
      checks P's params (decode_answer) but relays them to D verbatim, as vLLM's proxy does: a vLLM decode
      instance reads keys pdserve does not model (per-KV-group block lists, dcp_size, an expiry).
Both modes tell P the client's max_tokens (decode_max_tokens in P's kv_transfer_params): P refuses a prompt
that leaves no room for them with D's 400, before spending the prefill (a vLLM P ignores the key).
push: both legs leave at once (router/push.py).

Or not split:
colocated: the whole request goes to one `--kv-role both` instance of the pool, chosen by the policy; its
      answer (streamed or not) goes back as is. A failure is a 502 naming the instance.
selective disaggregation (pull, push with `colocate_below`): a request whose uncached suffix at the chosen
      decode instance (prompt tokens - the tokens the router believes D caches: router/kv_route.py; 0 unless
      the routing is kv-aware) is shorter than `colocate_below` tokens goes whole to that decode instance,
      without kv_transfer_params, and D prefills it locally; P never sees it. The prompt's tokens are exact for
      token ids (and text, with the router's tokenizer: router/prompt_tokens.py), else estimated
      (router/prompt_len.py).

Both legs carry the client's X-Request-Id. A client that disconnects cancels the legs in flight: their
connections close, and each backend aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response

from pdserve.kv.capability import KVAuth
from pdserve.kv.decode import decode_answer
from pdserve.kv.params import KVParamsError, PullSource, Refusal, RemoteDecode, encode
from pdserve.router.background import Background
from pdserve.router.call import Call, answered_prompt_ids, leg_body, prefill_body, reads_packed, relays_prompt_ids
from pdserve.router.health import HealthMonitor
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_route import Choice, KVRoute, KVWeights, PromptKeys
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import MODES, Pool
from pdserve.router.prefill_info import PrefillInfo
from pdserve.router.prompt_len import estimate_prompt_tokens
from pdserve.router.prompt_tokens import PromptTokens
from pdserve.router.push import Push
from pdserve.router.relay import relay_stream
from pdserve.router.upstream import LegError, encode_without_params, open_stream, post_json, with_params
from pdserve.web import race_disconnect

log = logging.getLogger(__name__)


class Orchestrator:
    """Runs calls in `mode` with one shared aiohttp session.

    pull/push: over the `prefill` and `decode` pools; colocated: `prefill` is None and `decode` is the pool of
    `--kv-role both` instances, each of which runs whole requests. `colocate_below` (pull/push only): requests
    whose uncached suffix at the chosen decode instance is shorter than this many tokens skip P and go whole to
    it; None = never. `route` chooses instances (by cache and load when the pools are kv-aware) and
    `prompts` gives a body's prompt token ids when the router can know them.
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
        route: KVRoute | None = None,
        prompts: PromptTokens | None = None,
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
        self.background = Background(session)  # releases, and P legs still finishing after D answered
        self._push = None if prefill is None else Push(prefill, decode, session, self.prefill_info, self.kv_auth,
                                                       self.background)  # fmt: skip
        self.monitor: HealthMonitor | None = None  # set by the app: re-checks before a refusal for health
        self.route = route or KVRoute(KVIndex([]), KVWeights(), RouterMetrics())  # instance choice per leg
        self.prompts = prompts or PromptTokens(None)  # a body's prompt token ids, when knowable

    @property
    def prefill(self) -> Pool:
        assert self._prefill is not None, "colocated mode has no prefill pool"
        return self._prefill

    def is_short(self, body: dict[str, Any], decode_hit_tokens: int = 0, num_tokens: int | None = None) -> bool:
        """Whether a pull/push call skips P: its uncached suffix at the chosen D (`num_tokens`, or the estimated
        prompt, less `decode_hit_tokens`) is below `colocate_below` tokens."""
        if self.colocate_below is None:
            return False
        if num_tokens is None:
            num_tokens = estimate_prompt_tokens(body)
        return num_tokens is not None and num_tokens - decode_hit_tokens < self.colocate_below

    async def handle(self, call: Call) -> Response:
        """The client's answer; raises LegError or ClientDisconnected."""
        prompt = await self.prompts.keys(call.parsed) if self.route.is_kv_aware(self.decode) else None
        if prompt is not None:
            await self.route.prepare(prompt)
        if self.mode == "colocated":
            return await self._whole(call, "instance", self.route.choose(self.decode, prompt))
        d: Choice | None = None
        if self.colocate_below is not None:
            d = self.route.choose(self.decode, prompt)
            if self.is_short(call.body, d.hit_tokens, None if prompt is None else prompt.num_tokens):
                return await self._whole(call, "decode", d)
        self.route.metrics.requests["split"] += 1
        if self.mode == "pull":
            return await self._pull(call, prompt, d)  # D is chosen when P has answered, unless chosen above
        assert self._push is not None
        p = self.route.used(self.prefill, self.route.choose(self.prefill, prompt))
        d = d or self.route.choose(self.decode, prompt)
        return await self._push.call(call, p, self.route.used(self.decode, d))

    # --- whole requests (colocated, or short prompts in pull/push) ---------------------------------------

    async def _whole(self, call: Call, leg: str, choice: Choice) -> Response:
        """Send the client's body, without kv_transfer_params, to the chosen instance of the decode pool; `leg`
        ("instance" or "decode") names it in errors."""
        call.is_whole = True
        self.num_whole += 1
        self.route.metrics.requests["whole"] += 1
        d = self.route.used(self.decode, choice)
        call.decode_url = d.url
        body = leg_body(call, {k: v for k, v in call.body.items() if k != "kv_transfer_params"}, reads_packed(d))
        if not call.is_stream:
            with self.decode.lease(d):
                answer = await race_disconnect(
                    post_json(self.session, leg, d.url, call.path, body, call.headers, call.events), call.http
                )
            return JSONResponse(answer, headers=call.headers)
        lease = self.decode.lease(d)
        try:
            resp = await race_disconnect(
                open_stream(self.session, leg, d.url, call.path, body, call.headers, call.events), call.http
            )
        except BaseException:
            lease.release()
            raise
        return relay_stream(call, resp, lease, [], leg)

    # --- pull -------------------------------------------------------------------------------------------

    async def _pull(self, call: Call, prompt: PromptKeys | None, d_choice: Choice | None) -> Response:
        """`d_choice`: D as chosen to decide whether P is needed (--colocate-below), used again after P answers
        while it is healthy, as push mode does: choosing twice would advance the pool's rotation twice per call,
        so with two D's every call would land on the same one. None: D is chosen when P has answered."""
        if not self.decode.has_healthy() and self.monitor is not None:
            await self.monitor.check_pool(self.decode)  # the marks may be up to one interval old
        if not self.decode.has_healthy():  # refuse before P spends a prefill (and pins blocks) for nothing
            urls = ", ".join(b.url for b in self.decode.backends)
            message = f"no healthy decode instance ({urls}); retry later"
            raise LegError("decode", urls, message, status=503, retry_after="1")
        p = self.route.used(self.prefill, self.route.choose(self.prefill, prompt))
        call.prefill_url = p.url
        with_ids = relays_prompt_ids(call)  # a text completion: D gets P's token ids, encoded once P answered
        # token ids go packed to the instances that read it (call.leg_body); D's body is encoded before D is chosen
        # in the form every decode instance reads (encoded again below in the rare mixed pool)
        d_packed = all(reads_packed(b) for b in self.decode.backends)
        with self.prefill.lease(p):
            p_body = leg_body(call, call.body, reads_packed(p))
            body = prefill_body(p_body, encode(RemoteDecode(None, None, None, call.max_tokens)), with_ids)
            p_leg = asyncio.ensure_future(
                post_json(self.session, "prefill", p.url, call.path, body, call.headers, call.events)
            )
            try:
                d_encoded = None if with_ids else await _encode_beside(p_leg, leg_body(call, call.body, d_packed))
            except BaseException:  # cancelled (the client went away): P's leg goes with it
                p_leg.cancel()
                raise
            answer = await race_disconnect(p_leg, call.http)
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
        if d_choice is None or not d_choice.backend.healthy:
            d_choice = self.route.choose(self.decode, prompt)  # now: load and cache as P answers
        d = self.route.used(self.decode, d_choice)
        call.decode_url = d.url
        if d_encoded is None:  # P's token ids of a text prompt
            ids = answered_prompt_ids(answer)
            d_encoded = encode_without_params(leg_body(call, call.body, reads_packed(d), ids))
        elif reads_packed(d) != d_packed:
            d_encoded = encode_without_params(leg_body(call, call.body, reads_packed(d)))
        d_body = with_params(d_encoded, None if kv is None else raw)  # verbatim: see the docstring
        try:
            if not call.is_stream:
                with self.decode.lease(d):
                    answer = await race_disconnect(
                        post_json(self.session, "decode", d.url, call.path, d_body, call.headers, call.events),
                        call.http,
                    )
                return JSONResponse(answer, headers=call.headers)
            d_lease = self.decode.lease(d)
            try:
                resp = await race_disconnect(
                    open_stream(self.session, "decode", d.url, call.path, d_body, call.headers, call.events), call.http
                )
            except BaseException:
                d_lease.release()
                raise
        except BaseException:  # D never took the KV (down, refused, client gone): P's pin is freed now
            if isinstance(kv, PullSource):
                self.background.release_on(p.url, {"request_id": kv.request_id, "kv_transfer_params": raw}, call)
            raise
        return relay_stream(call, resp, d_lease, [], "decode")


async def _encode_beside(p_leg: asyncio.Future[Any], body: dict[str, Any]) -> bytes:
    """D's body without its kv_transfer_params, encoded while P computes rather than after it answered: P's leg
    runs first, to its first wait (its request written on a pooled connection), then the prompt is encoded again."""
    await asyncio.sleep(0)
    return encode_without_params(body)
