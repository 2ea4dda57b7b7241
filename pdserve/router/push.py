"""Push mode's call: P and D are chosen at arrival and both legs leave at once with one fresh transfer_id; D's
kv_transfer_params carry P's coordinates from P's GET /kv_transfer/info (cached per P URL, prefill_info.py).
If P's leg fails, D's leg is cancelled and the client gets a 502 naming the prefill leg.

A failure that stale coordinates can explain (P's 403 for the router's capability, or a 5xx other than an
admission 503: D could not reach the P they named) drops the cached coordinates, fetches them again and,
when they changed (P restarted), retries once. A stale route is never the client's error.
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
from pdserve.kv.params import Mode, PushSource, RemoteDecode, encode
from pdserve.router.background import Background
from pdserve.router.call import Call, leg_body, prefill_body, reads_packed
from pdserve.router.policy import Backend, Pool
from pdserve.router.prefill_info import PrefillInfo, push_coordinates
from pdserve.router.relay import relay_stream
from pdserve.router.upstream import LegError, open_stream, post_json
from pdserve.web import ClientDisconnected, race_disconnect, until_disconnect

log = logging.getLogger(__name__)


def may_be_stale(e: LegError) -> bool:
    """Whether a failed leg may have carried P's outdated coordinates (P restarted since they were fetched)."""
    return e.status == 403 or (e.status >= 500 and e.status != 503)


class Push:
    """Push calls over the `prefill` and `decode` pools (one per router)."""

    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        session: aiohttp.ClientSession,
        prefill_info: PrefillInfo,
        kv_auth: KVAuth,
        background: Background,
    ) -> None:
        self.prefill, self.decode, self.session = prefill, decode, session
        self.prefill_info, self.kv_auth, self.background = prefill_info, kv_auth, background

    async def call(self, call: Call, p: Backend, d: Backend) -> Response:
        """Run the call on prefill instance `p` and decode instance `d` (chosen by the orchestrator)."""
        call.prefill_url, call.decode_url = p.url, d.url
        info = await race_disconnect(self.prefill_info.get(p.url), call.http)
        try:
            return await self._legs(call, p, d, info)
        except LegError as e:
            if not may_be_stale(e):
                raise
            first = e
        # the legs carried P's cached coordinates (engine id, side channel), signed: if P restarted since they
        # were fetched, P refuses them (403) or D cannot reach them. Fetch them again and retry once on new ones.
        self.prefill_info.forget(p.url)
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
            return await self._legs(call, p, d, fresh)
        except LegError as e:
            if e.leg == "prefill" and e.status == 403:
                raise LegError(
                    "prefill", p.url, f"prefill instance {p.url} changed its coordinates again during this request "
                    "(restarting?); retry later", status=503, retry_after="1",
                ) from e  # fmt: skip
            raise

    async def _legs(self, call: Call, p: Backend, d: Backend, info: dict[str, Any]) -> Response:
        """Both legs of a push call with P's coordinates `info`."""
        transfer_id = uuid.uuid4().hex
        host, port, engine_id = info["side_channel_host"], info["side_channel_port"], info["engine_id"]
        cap = self.kv_auth.issue_push(transfer_id, engine_id, host, port, DEFAULT_TTL_S)  # both legs carry it
        p_params = encode(RemoteDecode(Mode.PUSH, transfer_id, cap, call.max_tokens))
        p_body = prefill_body(leg_body(call, call.body, reads_packed(p)), p_params)  # ids packed: call.leg_body
        source = PushSource(transfer_id, host, port, engine_id, info.get("tp_size", 1), cap)
        d_body = {**leg_body(call, call.body, reads_packed(d)), "kv_transfer_params": encode(source)}
        p_task = asyncio.create_task(self._prefill_leg(p, p_body, call))
        d_lease = self.decode.lease(d)
        opener = open_stream if call.is_stream else post_json
        d_task: asyncio.Task[Any] = asyncio.create_task(
            opener(self.session, "decode", d.url, call.path, d_body, call.headers, call.events)
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
                # P may hold the prefill pinned; the P leg's params carry the capability the release needs
                which = {"transfer_id": transfer_id, "kv_transfer_params": p_body["kv_transfer_params"]}
                self.background.release_on(p.url, which, call)
                for t in (p_task, d_task):
                    t.cancel()
                results = await asyncio.gather(p_task, d_task, return_exceptions=True)
                if isinstance(results[1], aiohttp.ClientResponse):  # D's stream opened as P failed
                    results[1].close()
        self.background.finish(p_task, call)
        if not call.is_stream:
            d_lease.release()
            return JSONResponse(result, headers=call.headers)
        return relay_stream(call, result, d_lease, [p_task], "decode")

    async def _prefill_leg(self, p: Backend, body: dict[str, Any], call: Call) -> dict[str, Any]:
        with self.prefill.lease(p):
            return await post_json(self.session, "prefill", p.url, call.path, body, call.headers, call.events)
