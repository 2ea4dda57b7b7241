"""One request's life on the engine as the HTTP layer sees it: its output stream, the client-disconnect
watch that aborts it, and the one log line it leaves.

Invariant: every RequestRun is closed (`close()`), which aborts the engine request unless it finished, so
a client that goes away never leaves blocks behind.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.server.disconnect import ClientDisconnected, race_disconnect
from pdserve.server.protocol import ApiError
from pdserve.transfer.params import KVTransferParams

log = logging.getLogger("pdserve.server.requests")


class RequestRun:
    """Drives `engine.generate` for one request. Use `first()`, then `outputs()` or `final()`; always `close()`."""

    def __init__(
        self,
        engine: Any,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None,
        http_request: Request,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self._gen = engine.generate(request_id, prompt_token_ids, params, kv_transfer_params)
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

    async def first(self) -> RequestOutput | None:
        """The first output, watching for a disconnect; the engine's ValueError (bad input) becomes a 400."""
        try:
            return await race_disconnect(self._next(), self._http)
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
            "request %s status=%d prompt=%d cached=%d output=%d finish=%s ttft=%s latency=%.3fs",
            self.request_id,
            self.status,
            self.num_prompt_tokens,
            out.num_cached_tokens if out else 0,
            len(out.token_ids) if out else 0,
            out.finish_reason if out else None,
            ttft,
            now - self._arrival,
        )
