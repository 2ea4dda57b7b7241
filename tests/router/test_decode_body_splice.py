"""The legs' bodies in pull mode: the decode leg's spliced from the client's body encoded once (router/upstream.py:
encode_without_params, with_params) reads exactly as the body built from the parsed values would; a text completion's
decode leg gets P's token ids (router/call.py), and no other P leg asks for them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.requests import Request

from pdserve.openai_request import CHAT_PATH, COMPLETIONS_PATH, parse_request
from pdserve.router.call import Call, answered_prompt_ids, prefill_body, relays_prompt_ids
from pdserve.router.upstream import encode_json, encode_without_params, with_params
from pdserve.web import parse_json

PARAMS = {"remote_engine_id": "e", "remote_block_ids": list(range(64)), "kv_capability": {"mac": "ab" * 32}}


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": list(range(16384)), "max_tokens": 8, "stream": True},
        {"prompt": [1, 2], "kv_transfer_params": {"old": 1}, "model": "m"},  # the client's own params are replaced
        {"messages": [{"role": "user", "content": "lone \ud800 surrogate"}]},  # json.dumps' fallback
        {"prompt": "ünïcode ✓", "stop": ["\n"]},
        {},
    ],
)
@pytest.mark.parametrize("params", [PARAMS, None])
def test_spliced_body_equals_the_encoded_dict(body: dict[str, Any], params: Any) -> None:
    spliced = with_params(encode_without_params(body), params)
    expected = {**body, "kv_transfer_params": params}
    assert json.loads(spliced) == expected
    assert parse_json(spliced) == json.loads(encode_json(expected))


def _call(body: dict[str, Any], path: str = COMPLETIONS_PATH) -> Call:
    http = Request({"type": "http", "method": "POST", "path": path, "headers": []})
    return Call(path, body, "rid", http, False, parsed=parse_request(path, body))


def test_text_completions_get_p_token_ids_and_nothing_else_asks_for_them() -> None:
    text, ids, chat = (
        _call({"prompt": "hello"}),
        _call({"prompt": [1, 2], "return_token_ids": True}),
        _call({"messages": [{"role": "user", "content": "hi"}]}, CHAT_PATH),
    )
    assert relays_prompt_ids(text) and relays_prompt_ids(_call({"prompt": ["hello"]}))
    assert not relays_prompt_ids(ids) and not relays_prompt_ids(chat)
    assert prefill_body(text.body, {}, True)["return_token_ids"] is True
    assert "return_token_ids" not in prefill_body(ids.body, {})  # the client's own flag is D's leg's only
    answer = {"choices": [{"text": "x", "prompt_token_ids": [5, 6, 7]}]}
    assert answered_prompt_ids(answer) == [5, 6, 7]
    for broken in ({}, {"choices": []}, {"choices": [{"prompt_token_ids": [1, "2"]}]}, {"choices": [{}]}):
        assert answered_prompt_ids(broken) is None  # D's leg then carries the text, as before


@pytest.mark.parametrize(
    "ids, expected",
    [
        (list(range(16384)), list(range(16384))),
        ([2**70, -1], [2**70, -1]),  # any int: D's vocabulary answers for out-of-range ids
        ([1, True], None),  # a bool is no token id
        ([1, 2.0], None),
        ([1, None], None),
        ([1, [2]], None),
        ([], None),
        ("1,2", None),
    ],
)
def test_answered_ids_are_ints_checked_in_one_pass(ids: Any, expected: list[int] | None) -> None:
    """answered_prompt_ids checks every id's type at once (pydantic's core, not a Python loop), with the answers
    of the per-id check it replaced: ints of any size, never a bool, float, None or nested list."""
    assert answered_prompt_ids({"choices": [{"prompt_token_ids": ids}]}) == expected
