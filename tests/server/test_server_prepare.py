"""Request bodies -> prompt ids and SamplingParams, and the 400s for what the engine must not see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.model.tokenizer import Tokenizer
from pdserve.openai_request import ChatCompletionRequest, CompletionRequest
from pdserve.server.prepare import chat_prompt_ids, completion_prompt_ids, sampling_params
from pdserve.server.protocol import ApiError
from pdserve.web import ErrorResponse


@pytest.fixture(scope="module")
def tokenizer(make_byte_tokenizer: Callable[..., Any]) -> Tokenizer:
    return Tokenizer(make_byte_tokenizer(add_bos=True))


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "hi", **kw})


def test_prompt_forms(tokenizer: Tokenizer) -> None:
    ids = completion_prompt_ids(completion(prompt="hello"), tokenizer)
    assert ids == tokenizer.encode("hello")
    for prompt in (ids, [ids], ["hello"]):
        assert completion_prompt_ids(completion(prompt=prompt), tokenizer) == ids


@pytest.mark.parametrize("prompt, words", [(["a", "b"], "one prompt"), ([[1], [2]], "one prompt"), ([], "empty")])
def test_bad_prompts_fail_validation(prompt: Any, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        completion(prompt=prompt)


def test_lone_surrogates_are_a_sanitized_400(tokenizer: Tokenizer) -> None:
    """The tokenizer's own TypeError ("TextEncodeInput must be Union[...]") never reaches the client."""
    with pytest.raises(ApiError, match=r"prompt is not valid Unicode: lone surrogate '\\ud800' at character 1") as e:
        completion_prompt_ids(completion(prompt="a\ud800b"), tokenizer)
    assert e.value.status == 400 and "TypeError" not in e.value.message
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}])
    with pytest.raises(ApiError, match=r"messages\[1\]\.content is not valid Unicode") as e:
        chat_prompt_ids(chat, tokenizer)
    assert e.value.status == 400


def test_prompts_beyond_the_character_bound_are_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    per_token = tokenizer.max_chars_per_token
    assert per_token == 4 * len("<|im_start|>")  # the tiny byte tokenizer's longest token string
    max_chars = 256 * per_token
    longest_legal = "é" * 127  # two bytes each: 254 tokens + BOS = 255, the most max_model_len 256 allows
    assert len(completion_prompt_ids(completion(prompt=longest_legal), tokenizer, max_chars, 256)) == 255
    for text in ("x" * (max_chars + 1), "\ud800" * (max_chars + 1)):  # the bound comes first: cheap
        with pytest.raises(ApiError, match=f"has {max_chars + 1} characters, more than any prompt under") as e:
            completion_prompt_ids(completion(prompt=text), tokenizer, max_chars, 256)
        assert e.value.status == 400
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "y" * max_chars}])
    with pytest.raises(ApiError, match="the chat as its template renders it has"):
        chat_prompt_ids(chat, tokenizer, max_chars, 256)


def test_no_tokenizer_takes_token_ids_only() -> None:
    assert completion_prompt_ids(completion(prompt=[5, 6]), None) == [5, 6]
    with pytest.raises(ApiError, match="token ids"):
        completion_prompt_ids(completion(prompt="text"), None)
    with pytest.raises(ApiError, match="chat"):
        chat_prompt_ids(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), None)


def test_chat_template_and_text_parts(tokenizer: Tokenizer) -> None:
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi there"}])
    parts = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    )
    ids = chat_prompt_ids(plain, tokenizer)
    assert ids == chat_prompt_ids(parts, tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValidationError, match="image_url"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])


def test_sampling_params_mapping() -> None:
    body = completion(temperature=0, top_p=0.5, top_k=4, seed=3, stop="x", ignore_eos=True, stop_token_ids=[9])
    p = sampling_params(body, num_prompt_tokens=10, max_model_len=100, default_max_tokens=16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 0.0, 0.5, 4, 3)
    assert p.stop == ("x",) and p.stop_token_ids == (9,) and p.ignore_eos
    assert sampling_params(completion(), 10, 100, 16).temperature == 1.0
    assert sampling_params(completion(stop=["a", "b"]), 10, 100, 16).stop == ("a", "b")


def test_max_tokens_against_max_model_len() -> None:
    assert sampling_params(completion(), 95, 100, 16).max_tokens == 5  # a default is cut to what fits
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert sampling_params(chat, 30, 100, None).max_tokens == 70  # chat default: the rest of the context
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=7)
    assert sampling_params(chat, 30, 100, None).max_tokens == 7
    with pytest.raises(ApiError, match="prompt has 100 tokens.*max_model_len 100"):
        sampling_params(completion(), 100, 100, 16)
    with pytest.raises(ApiError, match="prompt has 10 tokens and max_tokens is 95: 105 .* max_model_len 100"):
        sampling_params(completion(max_tokens=95), 10, 100, 16)


def test_bad_sampling_values_fail_validation() -> None:
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}, {"n": 0}):
        with pytest.raises(ValidationError):
            completion(**kw)
    with pytest.raises(ValidationError, match="stop"):
        completion(stop=[""])


def test_error_shape() -> None:
    assert ErrorResponse.of(404, "gone").model_dump() == {
        "error": {"message": "gone", "type": "not_found_error", "param": None, "code": 404}
    }
