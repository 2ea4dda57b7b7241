"""Engine outputs -> OpenAI response bodies and SSE chunks, for completions and chat alike."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pdserve.engine.outputs import RequestOutput
from pdserve.kv.params import encode
from pdserve.prompt_pack import TokenArray, to_list
from pdserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from pdserve.server.streams import RequestRun
from pdserve.web import error_body

Kind = Literal["completion", "chat"]
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def kv_params(out: RequestOutput) -> dict[str, Any] | None:
    """P's answer (the connector's, typed) as the response's kv_transfer_params JSON object."""
    return None if out.kv_transfer_params is None else encode(out.kv_transfer_params)


class Renderer:
    """Shapes one request's outputs as the endpoint `kind` answers them."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        prompt_token_ids: list[int] | TokenArray,
        return_token_ids: bool,
        include_usage: bool,
    ) -> None:
        self.kind = kind
        self.response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.prompt_token_ids = prompt_token_ids
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage

    def usage(self, out: RequestOutput) -> Usage:
        num_prompt, num_output = len(self.prompt_token_ids), len(out.token_ids)
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_output,
            total_tokens=num_prompt + num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
        )

    def response(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streaming body for the finished output `out`."""
        prompt_ids = to_list(self.prompt_token_ids) if self.return_token_ids else None
        token_ids = list(out.token_ids) if self.return_token_ids else None
        usage = self.usage(out)
        if self.kind == "chat":
            choice = ChatChoice(
                message=ChatMessageOut(content=out.text),
                finish_reason=out.finish_reason,
                prompt_token_ids=prompt_ids,
                token_ids=token_ids,
            )
            body: Any = ChatCompletionResponse(
                id=self.response_id,
                model=self.model,
                usage=usage,
                choices=[choice],
                kv_transfer_params=kv_params(out),
            )
        else:
            choice_c = CompletionChoice(
                text=out.text, finish_reason=out.finish_reason, prompt_token_ids=prompt_ids, token_ids=token_ids
            )
            body = CompletionResponse(
                id=self.response_id,
                model=self.model,
                usage=usage,
                choices=[choice_c],
                kv_transfer_params=kv_params(out),
            )
        return body.model_dump(exclude_none=False)

    def chunk(
        self, text: str, token_ids: list[int], finish_reason: str | None, kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        ids = token_ids if self.return_token_ids else None
        if self.kind == "chat":
            choice = ChatChunkChoice(delta=DeltaMessage(content=text), finish_reason=finish_reason, token_ids=ids)
            body: Any = ChatCompletionChunk(id=self.response_id, model=self.model, choices=[choice])
        else:
            choice_c = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=ids)
            body = CompletionChunk(id=self.response_id, model=self.model, choices=[choice_c])
        body.kv_transfer_params = kv
        return body.model_dump()

    def role_chunk(self) -> dict[str, Any]:
        """Chat's first chunk: the assistant role with empty content."""
        choice = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=self.response_id, model=self.model, choices=[choice]).model_dump()

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        cls: Any = ChatCompletionChunk if self.kind == "chat" else CompletionChunk
        return cls(id=self.response_id, model=self.model, choices=[], usage=self.usage(out)).model_dump()

    async def events(self, run: RequestRun, first: RequestOutput | None) -> AsyncIterator[str]:
        """SSE events of a streaming answer, ending in [DONE]; an engine error becomes an error event.
        Closes `run` when done or when the response is cancelled (client gone)."""
        try:
            if self.kind == "chat":
                yield sse(self.role_chunk())
            sent_len = 0  # characters of text already sent
            pending_ids: list[int] = []  # token ids not sent yet (text held back by the detokenizer)
            out = first
            outputs = run.outputs()
            while out is not None:
                pending_ids.extend(out.new_token_ids)
                delta = out.text[sent_len:]
                if out.finished:
                    if out.finish_reason in ("error", "abort"):
                        run.status = 500
                        message = out.error or f"request {run.request_id} was aborted by the engine"
                        yield sse(error_body(500, message))
                    else:
                        yield sse(self.chunk(delta, pending_ids, out.finish_reason, kv_params(out)))
                        if self.include_usage:
                            yield sse(self.usage_chunk(out))
                    break
                if delta or pending_ids:  # a token whose text is held back still streams (empty text): TTFT/ITL
                    yield sse(self.chunk(delta, pending_ids, None, None))
                    sent_len, pending_ids = len(out.text), []
                try:
                    out = await anext(outputs, None)
                except Exception as e:  # the engine broke mid-stream
                    run.status = 500
                    yield sse(error_body(500, f"engine error: {e}"))
                    yield DONE
                    return
            if out is None:
                run.status = 500
                yield sse(error_body(500, "the engine ended the stream without finishing"))
            yield DONE
        finally:
            await run.close()
