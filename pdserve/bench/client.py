"""One streaming OpenAI request, timed: TTFT, every inter-token gap, end-to-end latency, output tokens.

Timing follows `vllm bench serve`: the clock starts just before the POST; the first chunk that carries a
token sets TTFT; each later token chunk appends its gap to `itl`; latency ends at the last token chunk (the
trailing usage chunk and `[DONE]` carry no token). Output tokens come from the stream's usage
(`stream_options.include_usage`) and fall back to the tokens counted in the chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.dataset import SampleRequest

# perf_counter is monotonic and fine-grained; add this to report unix times (the servers' timelines use them)
PERF_TO_UNIX = time.time() - time.perf_counter()


@dataclass
class RequestOutput:
    """What one request measured. Times in seconds."""

    request_id: str
    success: bool = False
    prompt_len: int = 0  # prompt tokens: the server's usage when given, else the generated length
    output_tokens: int = 0  # usage.completion_tokens, else the tokens counted in the chunks
    ttft: float = 0.0  # request sent -> first token chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    latency: float = 0.0  # request sent -> last token chunk
    start_time: float = 0.0  # unix time the request was sent
    generated_text: str = ""
    output_ids: list[int] = field(default_factory=list)  # the answer's token ids, when the chunks carry them
    error: str = ""
    user: int = 0  # the request's SampleRequest.user
    turn: int = 0  # the request's SampleRequest.turn


@dataclass(frozen=True)
class ClientConfig:
    """How every request of a run is sent."""

    api_url: str  # base URL + endpoint
    model: str  # the `model` field of the body
    is_chat: bool  # /v1/chat/completions (messages) instead of /v1/completions (prompt)
    ignore_eos: bool = False
    temperature: float = 0.0
    return_token_ids: bool = True  # ask for each chunk's token ids (vLLM's extension): exact token counts
    extra_body: dict[str, Any] | None = None


def build_payload(cfg: ClientConfig, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.expected_output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.is_chat:
        text = req.prompt if isinstance(req.prompt, str) else None
        if text is None:
            raise ValueError("the chat endpoint needs text prompts (dataset as_text=True)")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    if cfg.extra_body:
        body.update(cfg.extra_body)
    return body


def count_tokens(choice: dict[str, Any], is_chat: bool) -> int:
    """Tokens one streamed choice carries (0 for a role announcement or a bare finish marker).

    `token_ids` (sent when the request asks for `return_token_ids`) is exact; without it a chunk with text,
    or an empty one that is not a finish marker (a special token), counts as one token.
    """
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    if is_chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        if not text and ("role" in delta or "content" not in delta):
            return 0  # {"role": "assistant"} opener, or an empty delta
    else:
        text = choice.get("text") or ""
    if not text and choice.get("finish_reason") is not None:
        return 0  # the finish marker after the last token
    return 1


def choice_text(choice: dict[str, Any], is_chat: bool) -> str:
    if is_chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _sse_events(response: aiohttp.ClientResponse):
    """Yield the `data:` payloads of a server-sent event stream, one per event, as text."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode("utf-8").splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()
    for line in buffer.decode("utf-8").splitlines():  # a stream that ends without a blank line
        if line.startswith("data:"):
            yield line[5:].strip()


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, req: SampleRequest) -> RequestOutput:
    """Send one streaming request and time it; never raises (failures land in `error`)."""
    out = RequestOutput(request_id=req.request_id, prompt_len=req.prompt_len, user=req.user, turn=req.turn)
    headers = {"X-Request-Id": req.request_id}
    payload = build_payload(cfg, req)
    num_chunk_tokens = 0  # tokens seen in the stream's chunks
    text_parts: list[str] = []
    start = time.perf_counter()
    out.start_time = start + PERF_TO_UNIX
    last = start
    try:
        async with session.post(cfg.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                out.error = f"HTTP {response.status}: {body}"
                return out
            async for data in _sse_events(response):
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if "error" in message and not message.get("choices"):
                    raise RuntimeError(f"error in stream: {message['error']}")
                now = time.perf_counter()
                for choice in message.get("choices") or []:
                    num_tokens = count_tokens(choice, cfg.is_chat)
                    text_parts.append(choice_text(choice, cfg.is_chat))
                    if isinstance(choice.get("token_ids"), list):
                        out.output_ids.extend(int(t) for t in choice["token_ids"])
                    if num_tokens == 0:
                        continue
                    if num_chunk_tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)  # one gap per chunk, as vllm bench serve counts them
                    last = now
                    num_chunk_tokens += num_tokens
                usage = message.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = int(usage["prompt_tokens"])
        if num_chunk_tokens == 0:
            out.error = "the stream carried no token"
            return out
        out.output_tokens = out.output_tokens or num_chunk_tokens
        out.latency = last - start
        out.generated_text = "".join(text_parts)
        out.success = True
    except Exception as e:  # a dropped connection, a malformed chunk: one failed request, not a failed run
        out.error = f"{type(e).__name__}: {e}"
    return out
