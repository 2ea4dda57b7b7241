"""One request's life on the engine as the HTTP layer sees it: its output stream, the client-disconnect
watch that aborts it, and the one log line it leaves.

Invariant: every RequestRun is closed (`close()`), which aborts the engine request unless it finished, so
a client that goes away never leaves blocks behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from pdserve.engine.client import AddRequest, EngineClient
from pdserve.engine.outputs import RequestOutput
from pdserve.server.protocol import ApiError
from pdserve.web import ClientDisconnected, race_disconnect

log = logging.getLogger("pdserve.server.requests")


class RequestRun:
    """Drives `engine.generate` for one request. Use `first()`, then `outputs()` or `final()`; always `close()`."""

    def __init__(
        self,
        engine: EngineClient,
        command: AddRequest,
        http_request: Request,
        max_queue_wait_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = command.request_id
        self.client_request_id = command.client_request_id
        self.num_prompt_tokens = len(command.prompt_token_ids)
        self._gen = engine.generate(command)
        self._max_queue_wait_s = max_queue_wait_s  # still queued (never scheduled) after this: abort, 503
        self._http = http_request
        self.last: RequestOutput | None = None  # the latest output seen
        self._arrival = time.perf_counter()
        self._first_at: float | None = None  # perf_counter() of the first output
        self.status = 200  # HTTP status of the answer, for the log line
        self._closed = False
        self.on_close: Callable[[], None] | None = None  # called once, when closed

    @property
    def is_finished(self) -> bool:
        return self.last is not None and self.last.finished

    async def _next(self) -> RequestOutput | None:
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            return None
        self.last = out
        if self._first_at is None:
            self._first_at = time.perf_counter()
        return out

    async def _first_or_queue_timeout(self) -> RequestOutput | None:
        """The first output. A request still in the engine's waiting queue after max_queue_wait_s is aborted
        (503); one that has started computing (or, on D, waiting for its KV) by then is waited for to its end."""
        if self._max_queue_wait_s is None:
            return await self._next()
        task = asyncio.ensure_future(self._next())
        asked: asyncio.Future[bool] | None = None
        try:
            await asyncio.wait({task}, timeout=self._max_queue_wait_s)
            if task.done():
                return task.result()
            # the engine thread decides (at its next step boundary); the stream may end first (a dead engine
            # loop fails every stream and answers no command)
            asked = asyncio.ensure_future(self.engine.abort_if_queued(self.request_id))
            await asyncio.wait({task, asked}, return_when=asyncio.FIRST_COMPLETED)
            if not asked.done() and task.done() and task.exception() is None:
                out = task.result()
                if out is not None and out.finished and out.finish_reason == "abort":
                    await asked  # the engine sends its answer right after the abort output it caused
            if asked.done() and asked.result():
                self.status = 503
                raise ApiError(
                    503, f"server busy: request still queued after {self._max_queue_wait_s:g} s; retry later"
                )
            return await task
        finally:
            for t in (task, asked):
                if t is not None and not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def first(self) -> RequestOutput | None:
        """The first output, watching for a disconnect; the engine's ValueError (bad input) becomes a 400."""
        try:
            return await race_disconnect(self._first_or_queue_timeout(), self._http)
        except ApiError:
            raise
        except ValueError as e:
            self.status = 400
            raise ApiError(400, str(e)) from e
        except ClientDisconnected:
            raise
        except Exception as e:  # the engine broke (its loop died): a 500 that says why
            self.status = 500
            raise ApiError(500, f"engine error: {e}") from e

    async def final(self) -> RequestOutput | None:
        """Consume outputs up to the finished one (or the end of the stream), watching for a disconnect."""

        async def drain() -> RequestOutput | None:
            while not self.is_finished:
                if await self._next() is None:
                    break
            return self.last

        try:
            return await race_disconnect(drain(), self._http)
        except ClientDisconnected:
            raise
        except Exception as e:
            self.status = 500
            raise ApiError(500, f"engine error: {e}") from e

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs after the first, for a streaming response (the response itself notices disconnects)."""
        while not self.is_finished:
            out = await self._next()
            if out is None:
                return
            yield out

    async def close(self) -> None:
        """Abort the request unless it finished, close the engine stream, and log the request's one line."""
        if self._closed:
            return
        self._closed = True
        if not self.is_finished:
            self.engine.abort(self.request_id)
            if self.status == 200:
                self.status = 499  # nginx's "client closed request", for the log line only
        with contextlib.suppress(Exception):
            await self._gen.aclose()
        if self.on_close is not None:
            self.on_close()
        self._log()

    def _log(self) -> None:
        now = time.perf_counter()
        out = self.last
        ttft = f"{self._first_at - self._arrival:.3f}s" if self._first_at is not None else "-"
        log.info(
            "request %s client_id=%s status=%d prompt=%d cached=%d output=%d finish=%s ttft=%s latency=%.3fs",
            self.request_id,
            self.client_request_id or "-",
            self.status,
            self.num_prompt_tokens,
            out.num_cached_tokens if out else 0,
            len(out.token_ids) if out else 0,
            out.finish_reason if out else None,
            ttft,
            now - self._arrival,
        )
