"""OpenAI-shaped request and response bodies for /v1/completions and /v1/chat/completions.

Requests are pydantic models (validation errors become HTTP 400 with the reason). Responses are plain
pydantic models too, so their shape is written down once; `kv_transfer_params` is a top-level field of both
the request and the response, as in vLLM, so vLLM-style P/D proxies work unchanged.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


# extension fields (vLLM's) are left out of a response when empty, so plain OpenAI clients see plain shapes
def _is_none(value: Any) -> bool:
    return value is None


# --- requests -------------------------------------------------------------------------------------------


class KVReleaseRequest(BaseModel):
    """POST /kv_transfer/release (the router, after D's leg failed): free P's pinned KV for one request now."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(default=None, max_length=256)  # pull: remote_request_id of P's answer
    transfer_id: str | None = Field(default=None, max_length=256)  # push: the router's transfer id


class StreamOptions(BaseModel):
    include_usage: bool = False  # send a last chunk with `usage` and no choices before [DONE]


class SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None = the first served model name
    max_tokens: int | None = Field(default=None, ge=1)  # None = the endpoint's default
    temperature: float | None = Field(default=None, ge=0.0)  # None = 1.0; 0 = greedy
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: generate past EOS up to max_tokens
    n: int = Field(default=1, ge=1)  # only 1 is served
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM extension: add prompt_token_ids and token_ids to each choice
    kv_transfer_params: dict[str, Any] | None = None  # P/D coordinates: parsed by transfer/params.py in api.py

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    # a string, a token-id list, or a one-element list of either (several prompts per request are refused)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False  # refused when true
    logprobs: int | None = None  # refused when set
    best_of: int | None = None  # refused when > 1


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str  # only "text" is served
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ChatContentPart] | None = None

    def text(self) -> str:
        """The message's text; list content must be text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"message content of type {part.type!r} is not supported; only text")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name for max_tokens
    logprobs: bool = False  # refused when true

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses ------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache or received from a prefill instance


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while streaming
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # only with return_token_ids
    token_ids: list[int] | None = Field(
        default=None, exclude_if=_is_none
    )  # only with return_token_ids; this chunk's when streaming


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)  # only in the first chunk
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # only with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only in the last chunk, with include_usage
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, exclude_if=_is_none
    )  # only in the chunk that finishes it


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, exclude_if=_is_none
    )  # only in the chunk that finishes it


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None  # what the server loaded (path or built-in name), as vLLM reports it
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- errors ---------------------------------------------------------------------------------------------


class ApiError(Exception):
    """Raised by request handling; the app turns it into `pdserve.web.error_response(status, message)`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
