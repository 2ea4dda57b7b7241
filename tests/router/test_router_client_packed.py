"""A client that sends the packed prompt (prompt_pack.FIELD) straight to the router: its length is counted (so
--colocate-below applies without a tokenizer), its ids are hashed for kv-aware routing, and each leg carries it
as the instance reads it: the client's value to one that reads the packed form, a JSON list to one that does not
(router/call.py leg_body). Bodies are built as the router builds them (parse_request, Call); milliseconds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from pdserve.openai_request import COMPLETIONS_PATH, parse_request
from pdserve.prompt_pack import FIELD, pack
from pdserve.router.call import Call, leg_body
from pdserve.router.prompt_len import estimate_prompt_tokens
from pdserve.router.prompt_tokens import PromptTokens


def _call(body: dict[str, Any]) -> Call:
    http = Request({"type": "http", "method": "POST", "path": COMPLETIONS_PATH, "headers": []})
    return Call(COMPLETIONS_PATH, body, "rid", http, False, parsed=parse_request(COMPLETIONS_PATH, body))


@pytest.mark.parametrize("num_ids", [1, 2, 3, 4, 5, 16384])  # every base64 padding
def test_packed_prompt_length_is_exact(num_ids: int) -> None:
    ids = [(i * 7919) % 50000 for i in range(num_ids)]
    assert estimate_prompt_tokens({FIELD: pack(ids), "max_tokens": 3}) == num_ids
    assert estimate_prompt_tokens({"prompt": ids}) == num_ids


def test_each_leg_gets_the_clients_packed_ids_as_it_reads_them() -> None:
    ids = [5, 6, 7, 300, 9]
    body = {FIELD: pack(ids), "max_tokens": 4, "temperature": 0}
    call = _call(body)
    packed_leg = leg_body(call, call.body, True)
    assert packed_leg == body  # the client's value, passed on
    json_leg = leg_body(call, call.body, False)
    assert json_leg == {"prompt": ids, "max_tokens": 4, "temperature": 0}  # no FIELD for an instance without it
    assert parse_request(COMPLETIONS_PATH, json_leg).prompt == ids
    assert call.body == body  # the client's body untouched
    plain = _call({"prompt": ids, "max_tokens": 4})  # a JSON list: packed only for an instance that reads it
    assert leg_body(plain, plain.body, False) is plain.body
    assert leg_body(plain, plain.body, True) == {FIELD: pack(ids), "max_tokens": 4}


def test_packed_ids_hash_as_the_same_list() -> None:
    ids = list(range(100, 164))
    prompts = PromptTokens(None)
    packed, plain = (asyncio.run(prompts.keys(_call(body).parsed)) for body in ({FIELD: pack(ids)}, {"prompt": ids}))
    assert packed is not None and plain is not None
    assert packed.num_tokens == plain.num_tokens == len(ids)
    assert list(packed.token_ids) == list(plain.token_ids) == ids
