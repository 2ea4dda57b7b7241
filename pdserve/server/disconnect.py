"""Noticing that an HTTP client went away, for handlers that wait a long time before answering.

Light on purpose (starlette only): the router uses it too, and the router imports neither engine nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


async def until_disconnect(request: Request) -> None:
    """Return when the client disconnects. Call only after the request body has been read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
