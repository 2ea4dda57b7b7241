"""HTTP calls from the router to its backends over one pooled aiohttp session, with failures named by leg.

A failure becomes LegError: a backend's own 4xx answer is passed through to the client as is (the client
sent something wrong), and so is a 503 with its Retry-After (the backend is full or loading: the client should
retry); an unreachable backend, another 5xx or a broken answer becomes a 502 whose message names the leg
("prefill" or "decode") and the backend's URL.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pydantic_core

from pdserve.web import error_body, parse_json


class LegError(Exception):
    """One leg of a request failed; `status` and `body` are what the client gets."""

    def __init__(
        self,
        leg: str,
        url: str,
        message: str,
        status: int = 502,
        body: dict[str, Any] | None = None,
        retry_after: str | None = None,
    ):
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for the client's Retry-After header (503s)
        self.leg = leg  # "prefill" | "decode"
        self.url = url
        self.status = status
        self.body = body if body is not None else error_body(status, message)


def make_session(connect_timeout_s: float, api_key: str | None = None) -> aiohttp.ClientSession:
    """One session for the router's life: pooled keep-alive connections, no read timeout (streams and long
    prefills take as long as they take), a bounded connect time so a dead backend fails fast; every call
    carries `Authorization: Bearer api_key` when one is given."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)  # backends keep idle connections for 30 s
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, headers=headers, json_serialize=encode_json
    )


def encode_json(body: Any) -> str:
    """A leg's body as JSON text: pydantic-core's encoder, ~3x faster than json.dumps on a prompt's token ids (16k
    ids: a few ms less on the path to P and, in pull mode, to D); what it cannot write (a string holding a lone
    surrogate, which json reads and the instance refuses with its own 400) as json.dumps writes it."""
    try:
        return pydantic_core.to_json(body).decode()
    except ValueError:
        return json.dumps(body)


def encode_without_params(body: dict[str, Any]) -> bytes:
    """`body` without its kv_transfer_params, as JSON: the part of a decode leg's body known before P answers."""
    return encode_json({k: v for k, v in body.items() if k != "kv_transfer_params"}).encode()


def with_params(encoded: bytes, kv_transfer_params: Any) -> bytes:
    """An encode_without_params() body with `"kv_transfer_params": ...` added as its last key: the decode leg's body
    without encoding the prompt again on the relay's path (16k ids: ~0.6 ms on the dev host)."""
    params = encode_json(kv_transfer_params).encode()
    if encoded.rstrip() == b"{}":
        return b'{"kv_transfer_params":' + params + b"}"
    if not encoded.endswith(b"}"):  # a check that stays under python -O: the splice needs an object's last brace
        raise ValueError("with_params() needs an encode_without_params() body (a JSON object)")
    return encoded[:-1] + b',"kv_transfer_params":' + params + b"}"


def _error_message(payload: Any, text: str) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", text))
    return text[:500]


async def _fail_from_response(leg: str, url: str, resp: aiohttp.ClientResponse) -> LegError:
    """LegError for a non-200 answer (reads its body)."""
    text = await resp.text(errors="replace")
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    message = _error_message(payload, text)
    if resp.status == 503:  # the backend is busy (admission control) or loading: the client should retry
        body = payload if isinstance(payload, dict) else error_body(503, message)
        return LegError(leg, url, message, status=503, body=body, retry_after=resp.headers.get("Retry-After", "1"))
    if 400 <= resp.status < 500:  # the backend refused the request itself: pass its answer through
        body = payload if isinstance(payload, dict) else error_body(resp.status, message)
        return LegError(leg, url, message, status=resp.status, body=body)
    return LegError(leg, url, f"{leg} leg to {url} failed with HTTP {resp.status}: {message}")


def _unreachable(leg: str, url: str, e: BaseException) -> LegError:
    reason = str(e) or type(e).__name__
    return LegError(leg, url, f"{leg} leg to {url} failed: {reason}")


def _mark(events: dict[str, float] | None, event: str) -> None:
    if events is not None:
        events.setdefault(event, time.time())


def _encoded(
    leg: str, body: dict[str, Any] | bytes, headers: dict[str, str], events: dict[str, float] | None
) -> tuple[bytes, dict[str, str]]:
    """A leg's body as JSON bytes (bytes: already encoded) and its headers; marks `<leg>_sent` in `events` (the
    call's timeline)."""
    data = body if isinstance(body, bytes) else encode_json(body).encode()
    _mark(events, f"{leg}_sent")
    return data, {**headers, "Content-Type": "application/json"}


async def post_json(
    session: aiohttp.ClientSession,
    leg: str,
    url: str,
    path: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    events: dict[str, float] | None = None,
) -> dict[str, Any]:
    """POST `body` to url+path and return the JSON answer; raises LegError. `events`: the call's edge timeline,
    where `<leg>_sent`, `<leg>_answered` (status and headers in) and `<leg>_read` (answer parsed) are marked."""
    data, headers = _encoded(leg, body, headers, events)
    try:
        async with session.post(url + path, data=data, headers=headers) as resp:
            _mark(events, f"{leg}_answered")
            if resp.status != 200:
                raise await _fail_from_response(leg, url, resp)
            payload = await resp.json(content_type=None, loads=parse_json)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise _unreachable(leg, url, e) from e
    _mark(events, f"{leg}_read")
    if not isinstance(payload, dict):
        raise LegError(leg, url, f"{leg} leg to {url} answered with something other than a JSON object")
    return payload


async def open_stream(
    session: aiohttp.ClientSession,
    leg: str,
    url: str,
    path: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    events: dict[str, float] | None = None,
) -> aiohttp.ClientResponse:
    """POST `body` and return the response once its status is 200 (the caller reads and closes it); `events` as
    in post_json (`<leg>_read` is the caller's)."""
    data, headers = _encoded(leg, body, headers, events)
    try:
        resp = await session.post(url + path, data=data, headers=headers)
        _mark(events, f"{leg}_answered")
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _unreachable(leg, url, e) from e
    if resp.status != 200:
        try:
            raise await _fail_from_response(leg, url, resp)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _unreachable(leg, url, e) from e
        finally:
            resp.release()
    return resp


async def get_json(session: aiohttp.ClientSession, leg: str, url: str, path: str, timeout_s: float) -> Any:
    """GET url+path within `timeout_s` and return the JSON answer; raises LegError."""
    try:
        async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise await _fail_from_response(leg, url, resp)
            return await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise _unreachable(leg, url, e) from e


async def get_bytes(
    session: aiohttp.ClientSession,
    leg: str,
    url: str,
    path: str,
    params: dict[str, str],
    timeout_s: float,
    max_bytes: int,
) -> bytes:
    """GET url+path?params (URL-encoded) within `timeout_s` and return the body, read up to `max_bytes`; raises
    LegError, also for a longer body (the connection is then closed unread)."""
    try:
        async with session.get(url + path, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise await _fail_from_response(leg, url, resp)
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > max_bytes:
                    resp.close()
                    raise LegError(leg, url, f"{leg} answer from {url} is longer than {max_bytes} bytes")
            return bytes(body)
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _unreachable(leg, url, e) from e
