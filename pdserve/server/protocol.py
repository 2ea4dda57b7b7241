"""OpenAI-shaped response bodies for /v1/completions and /v1/chat/completions, and the server's ApiError.

Requests are validated by `pdserve/openai_request.py`, which the router shares (validation errors become HTTP
400 with the reason). Responses are pydantic models too, so their shape is written down once;
`kv_transfer_params` is a top-level field of both the request and the response, as in vLLM, so vLLM-style P/D
proxies work unchanged.
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
    # the request's capability (needed with a deployment secret unless the caller shows the internal API key):
    # pull: P's answer (its kv_transfer_params) as the router got it; push: the prefill leg's kv_transfer_params
    kv_transfer_params: dict[str, Any] | None = None


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
