"""The request model the server and the router share: strict types, null = default, unsupported options."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.openai_request import CHAT_PATH, COMPLETIONS_PATH, MAX_STOP, UNSUPPORTED, parse_request
from pdserve.web import json_content_type_error


def completion(**fields: Any) -> Any:
    return parse_request(COMPLETIONS_PATH, {"prompt": "hi", **fields})


def chat(**fields: Any) -> Any:
    return parse_request(CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 4.0}, "max_tokens: Input should be a valid integer"),
        ({"top_k": "3"}, "top_k"),
        ({"temperature": float("nan")}, "temperature: Input should be a finite number"),
        ({"top_p": float("inf")}, "top_p: Input should be a finite number"),
        ({"temperature": True}, "temperature"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stream": "false"}, "stream: Input should be a valid boolean"),
        ({"stream": 0}, "stream"),
        ({"n": 2}, "n: Input should be less than or equal to 1"),
        ({"stop": ["a"] * (MAX_STOP + 1)}, f"stop: must be a non-empty string or a list of at most {MAX_STOP}"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported by pdserve (only 0 or null is accepted)"),
        ({"presence_penalty": False}, "presence_penalty"),  # false is not 0
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": 0}, "logprobs is not supported by pdserve (only null is accepted), got 0"),
        ({"echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "prompt: one prompt per request is served, got 2"),
        ({"prompt": []}, "prompt: prompt is empty"),
        ({"prompt": [1, True]}, "prompt: must be a string, a list of token ids"),
        ({"prompt": [-1]}, "prompt"),
    ],
)
def test_completion_refusals_name_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match="^invalid request: ") as e:
        completion(**fields)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": [{"role": "bob", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: must be a string or a list"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "of type 'image_url'"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
        ({"messages": []}, "messages"),
        ({"logprobs": True}, "logprobs is not supported by pdserve (only false or null is accepted)"),
        ({"max_completion_tokens": False}, "max_completion_tokens"),
    ],
)
def test_chat_refusals_name_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as e:
        chat(**fields)
    assert words in str(e.value)


def test_neutral_values_and_nulls_are_accepted() -> None:
    body = completion(**UNSUPPORTED, echo=False, suffix="", logprobs=None, n=None, stream=None, ignore_eos=None)
    assert (body.n, body.stream, body.ignore_eos) == (1, False, False)  # null means the default
    assert chat(**{name: None for name in UNSUPPORTED}, logprobs=False).requested_max_tokens is None
    assert completion(temperature=0, top_p=1, seed=-(2**63)).temperature == 0  # an integer is a number
    assert completion(unknown_field={"x": 1}).prompt == "hi"  # unknown fields are ignored
    assert completion(prompt=[[5, 6]]).prompt == [5, 6] and completion(prompt=["hey"]).prompt == "hey"


def test_chat_roles_and_text_parts() -> None:
    for role in ("system", "developer", "user", "assistant", "tool"):
        chat(messages=[{"role": role, "content": "x"}])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat(messages=[{"role": "user", "content": parts}]).messages[0].text() == "ab"


def test_json_content_type() -> None:
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
        assert json_content_type_error(ok) is None
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        assert "Content-Type must be application/json" in (json_content_type_error(bad) or "")
