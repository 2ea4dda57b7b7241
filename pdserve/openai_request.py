"""OpenAI request bodies for /v1/completions and /v1/chat/completions, validated: what the server and the
router both parse, so a body one of them refuses the other refuses too, before any work is done.

Light on purpose (pydantic, and numpy for the router's packed prompt: prompt_pack.py): the router imports this and
nothing of `pdserve.server`.

The rules, one place for both (docs/architecture.md, "The HTTP edge"):
- types are strict: an integer field takes neither `true` nor `1.0` nor `"1"`, a boolean takes neither `1` nor
  `"false"`, a number is finite (no NaN or Infinity), a seed fits in int64;
- `null` for a field means its default;
- options pdserve does not implement (UNSUPPORTED) are refused by name unless given their neutral value;
- unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import array
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdserve import prompt_pack
from pdserve.prompt_pack import TokenArray

MAX_STOP = 1024  # entries of `stop` and of `stop_token_ids` at most
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"

FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]  # a JSON number (an integer too), never NaN/inf
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0)]


def _non_negative(token_ids: list[int]) -> list[int]:
    """Refuse a negative id among integers: packed as uint64 at once (~0.2 ms for 16k ids), where a per-item
    `ge=0` constraint made pydantic ~3x slower over a list (16k ids: ~1 ms more, at the router and every instance
    on the first token's path). An id of 2**64 or more is no error here (the engine's vocabulary refuses it)."""
    try:
        array.array("Q", token_ids)
    except OverflowError:
        if any(t < 0 for t in token_ids):
            raise PydanticCustomError("negative", "token ids must be >= 0") from None
    return token_ids


PromptIds = Annotated[list[StrictInt], AfterValidator(_non_negative)]  # a prompt's token ids: integers >= 0


StopString = Annotated[StrictStr, Field(min_length=1)]
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


def _one_of(expected: str) -> WrapValidator:
    """A union's errors as one message saying what is `expected` (pydantic reports every member's failure,
    each under a type name, which reads as noise to a client); a refused option inside it keeps its own."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            refusals = [err["msg"] for err in e.errors() if err["type"] == "unsupported"]
            if refusals:
                raise PydanticCustomError("unsupported", "{message}", {"message": refusals[0]}) from None
            raise PydanticCustomError("union", "must be " + expected) from None

    return WrapValidator(validate)


def _is_neutral(value: Any, neutral: Any) -> bool:
    """`value == neutral`, except that a boolean is not a number (`True == 1` in Python)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    return bool(value == neutral)


# option -> its neutral value (accepted; anything else is refused naming the option). `null` is neutral too.
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "length_penalty": 1,
    "min_p": 0,
    "min_tokens": 0,
    "logit_bias": {},
    "top_logprobs": 0,
    "prompt_logprobs": 0,
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "response_format": {"type": "text"},
    "guided_json": {},
    "guided_regex": "",
    "guided_choice": [],
    "guided_grammar": "",
    "use_beam_search": False,
    "best_of": 1,
}
# the same, for one endpoint only (a completion's `logprobs` is a count, where 0 already asks for logprobs)
UNSUPPORTED_COMPLETION: dict[str, Any] = {"echo": False, "suffix": "", "logprobs": None}
UNSUPPORTED_CHAT: dict[str, Any] = {"logprobs": False}


def _refuse_unsupported(data: Any, table: dict[str, Any]) -> None:
    if not isinstance(data, dict):
        return  # pydantic says what is wrong with it
    for name, neutral in table.items():
        value = data.get(name)
        if value is not None and not _is_neutral(value, neutral):
            accepted = "null" if neutral is None else f"{json.dumps(neutral)} or null"
            raise PydanticCustomError(
                "unsupported",
                "{name} is not supported by pdserve (only {accepted} is accepted), got {value}",
                {"name": name, "accepted": accepted, "value": json.dumps(value, default=repr)[:100]},
            )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False  # send a last chunk with `usage` and no choices before [DONE]


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None  # None = the first served model name
    max_tokens: StrictInt | None = Field(default=None, ge=1)  # None = the endpoint's default
    temperature: FiniteFloat | None = Field(default=None, ge=0.0)  # None = 1.0; 0 = greedy
    top_p: FiniteFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM extension; 0 or -1 = off
    seed: Int64 | None = None
    stop: (
        Annotated[
            StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)],
            _one_of(f"a non-empty string or a list of at most {MAX_STOP} of them"),
        ]
        | None
    ) = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None  # vLLM extension
    ignore_eos: StrictBool = False  # vLLM extension: generate past EOS up to max_tokens
    n: StrictInt = Field(default=1, ge=1, le=1)  # only 1 is served
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False  # vLLM extension: add prompt_token_ids and token_ids to each choice
    kv_transfer_params: dict[str, Any] | None = None  # P/D coordinates: parsed by kv/decode.py

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        """`"field": null` means the field's default; unsupported options are refused (UNSUPPORTED)."""
        if not isinstance(data, dict):
            return data
        _refuse_unsupported(data, UNSUPPORTED)
        return {k: v for k, v in data.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """The output length the client asked for (None: the endpoint's default)."""
        return self.max_tokens


class CompletionRequest(SamplingFields):
    # a string or token ids; a one-element list of either is unwrapped (several prompts are refused). The router's
    # legs may send the ids packed instead (prompt_pack.FIELD): validated here, they are `prompt` as an int64 array
    prompt: Annotated[
        StrictStr | PromptIds | prompt_pack.UnpackedIds,
        _one_of("a string, a list of token ids (integers >= 0), or a list holding one of either"),
    ]

    @model_validator(mode="before")
    @classmethod
    def _completion_only(cls, data: Any) -> Any:
        _refuse_unsupported(data, UNSUPPORTED_COMPLETION)
        return prompt_pack.into_prompt(data)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _unpacked_as_is(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """The array prompt_pack.into_prompt made is the prompt as it is: the union would try it as a list first, id
        by id (~5 ms for 16k ids)."""
        return prompt_pack.as_array(prompt) if isinstance(prompt, np.ndarray) else handler(prompt)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """A list holding one prompt (text or ids) is that prompt; several prompts per request are refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise PydanticCustomError("one_prompt", "one prompt per request is served, got {n}", {"n": len(prompt)})
            return prompt[0]
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int] | TokenArray) -> str | list[int] | TokenArray:
        if isinstance(prompt, list) and not prompt:  # text may still tokenize to a BOS: the instance decides
            raise PydanticCustomError("empty", "prompt is empty")
        return prompt


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]  # only text is served (an image part is refused, naming its type)
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text" and isinstance(data.get("type"), str):
            raise PydanticCustomError(
                "unsupported", "message content of type '{type}' is not supported; only text", {"type": data["type"]}
            )
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: Annotated[StrictStr | list[ChatContentPart], _one_of("a string or a list of text parts")] | None = (
        None  # None: an empty message
    )

    def text(self) -> str:
        """The message's text (list content is text parts only, checked at validation)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)  # newer name for max_tokens

    @model_validator(mode="before")
    @classmethod
    def _chat_only(cls, data: Any) -> Any:
        _refuse_unsupported(data, UNSUPPORTED_CHAT)
        return data

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


REQUEST_TYPES: dict[str, type[SamplingFields]] = {COMPLETIONS_PATH: CompletionRequest, CHAT_PATH: ChatCompletionRequest}


def describe(errors: Sequence[Any]) -> str:
    """pydantic's errors as one 400 message naming each field: "invalid request: top_p: Input should be...".
    `body` (FastAPI's prefix for the request body) is left out of the field paths."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def parse_request(path: str, body: dict[str, Any]) -> SamplingFields:
    """The body of a POST to `path` (COMPLETIONS_PATH or CHAT_PATH), validated; raises ValueError with
    describe()'s message."""
    try:
        return REQUEST_TYPES[path].model_validate(body)
    except ValidationError as e:
        raise ValueError(describe(e.errors())) from None
