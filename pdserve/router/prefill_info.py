"""Push mode: each prefill instance's GET /kv_transfer/info (its side channel and engine id), fetched once.

Lives apart from the orchestrator because it is a cache with its own life cycle: concurrent calls share one
fetch, a failed fetch is not kept, and a leg that fails or a health check that sees P restart forgets the
entry so the next call fetches P's new coordinates. The checks name what to fix (role, transfer mode).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from pdserve.router.upstream import LegError, get_json


def push_coordinates(info: dict[str, Any]) -> tuple[Any, ...]:
    """What a push capability names of P (its engine id and side channel): equal before and after a refresh
    unless P restarted."""
    return info.get("engine_id"), info.get("side_channel_host"), info.get("side_channel_port")


class PrefillInfo:
    """P URL -> its /kv_transfer/info (a shared future per URL), fetched with `session` within `timeout_s`."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self._infos: dict[str, asyncio.Future[dict[str, Any]]] = {}

    def forget(self, url: str) -> None:
        """Drop P's cached /kv_transfer/info (P restarted: its next request fetches the new coordinates)."""
        self._infos.pop(url, None)

    async def get(self, url: str) -> dict[str, Any]:
        """P's GET /kv_transfer/info, fetched once per URL (concurrent callers share the fetch)."""
        fut = self._infos.get(url)
        if fut is None:
            fut = asyncio.ensure_future(self._fetch_info(url))
            self._infos[url] = fut
        try:
            return await asyncio.shield(fut)
        except LegError:
            self._infos.pop(url, None)
            raise

    async def _fetch_info(self, url: str) -> dict[str, Any]:
        info = await get_json(self.session, "prefill", url, "/kv_transfer/info", self.timeout_s)
        if not isinstance(info, dict):
            raise LegError("prefill", url, f"prefill leg to {url}: /kv_transfer/info is not a JSON object")
        role, mode = info.get("kv_role"), info.get("transfer_mode")
        if role not in (None, "prefill"):
            raise LegError(
                "prefill",
                url,
                f"{url} is not a prefill instance (kv role {role!r}); "
                "push mode needs --kv-role prefill --kv-transfer push",
            )
        if mode != "push":
            raise LegError(
                "prefill",
                url,
                f"prefill instance {url} transfers KV in {mode!r} mode but the router runs in push mode; "
                "start both instances with --kv-transfer push",
            )
        missing = [k for k in ("engine_id", "side_channel_host", "side_channel_port") if k not in info]
        if missing:
            raise LegError("prefill", url, f"prefill leg to {url}: /kv_transfer/info lacks {', '.join(missing)}")
        return info
