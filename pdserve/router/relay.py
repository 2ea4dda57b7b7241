"""Relay a backend's SSE stream (D's, or a colocated instance's) to the client, byte for byte.

Lives apart from the orchestrator because every mode ends the same way on a stream: the lease on the backend is
held until the stream ends, a client that goes away closes the backend's connection (the backend aborts) and
cancels the other legs, and a backend that breaks mid-stream becomes one error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from pdserve.router.call import Call
from pdserve.router.policy import Lease
from pdserve.web import error_body

log = logging.getLogger(__name__)


def _error_event(message: str) -> bytes:
    return f"data: {json.dumps(error_body(502, message))}\n\ndata: [DONE]\n\n".encode()


def relay_stream(
    call: Call, resp: aiohttp.ClientResponse, lease: Lease, others: list[asyncio.Task[Any]], leg: str
) -> Response:
    """Pass D's (or, colocated, the instance's) SSE bytes through. When the client goes away, D's
    connection is closed (D aborts) and the legs in `others` are cancelled; at the end the lease on D is
    released. `leg` names D in a mid-stream error."""
    state = {"complete": False}

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
            state["complete"] = True
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("request %s: %s stream from %s broke: %s", call.request_id, leg, call.decode_url, e)
            state["complete"] = True  # the connection is gone anyway
            yield _error_event(f"{leg} leg to {call.decode_url} failed mid-stream: {e or type(e).__name__}")
        finally:
            await cleanup()

    async def cleanup() -> None:
        lease.release()
        if state["complete"]:
            resp.release()
        else:
            resp.close()  # closes the connection: D sees the disconnect and aborts
            for t in others:
                t.cancel()

    media_type = resp.headers.get("Content-Type", "text/event-stream")
    return StreamingResponse(relay(), media_type=media_type, headers=call.headers, background=BackgroundTask(cleanup))
