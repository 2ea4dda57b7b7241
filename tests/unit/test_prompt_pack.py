"""The packed prompt of the router's legs (pdserve/prompt_pack.py): what the router writes an instance reads back
exactly, every malformed value is a 400 message naming the field, and the instance's checks (vocabulary, the
capability's prompt digest) read the unpacked array as they read the JSON list."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
from starlette.requests import Request

from pdserve import prompt_pack
from pdserve.auth import prompt_digest
from pdserve.engine.limits import RequestLimits
from pdserve.openai_request import COMPLETIONS_PATH, parse_request
from pdserve.router.call import Call, leg_body, reads_packed
from pdserve.router.policy import Backend

FIELD = prompt_pack.FIELD


def test_round_trip_is_exact_and_read_only() -> None:
    rng = random.Random(0)
    ids = [0, 1, 2**32 - 1] + [rng.randrange(2**32) for _ in range(5000)]
    packed = prompt_pack.pack(ids)
    assert packed is not None and packed.startswith("v1:")
    assert base64.b64decode(packed[3:]) == np.array(ids, dtype="<u4").tobytes()  # the wire: little-endian uint32
    out = prompt_pack.unpack(packed)
    assert out.dtype == np.int64 and out.tolist() == ids and not out.flags.writeable
    assert prompt_pack.to_list(out) == ids and type(prompt_pack.to_list(out)[0]) is int


@pytest.mark.parametrize("ids", [[-1], [2**32], [1, 2**40], [2**64]])
def test_ids_that_cannot_be_packed_stay_json(ids: list[int]) -> None:
    assert prompt_pack.pack(ids) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("v1:AAA", "is not valid base64"),  # truncated: no padding
        ("v1:AAAA AAAA", "is not valid base64"),
        ("v1:!!!!", "is not valid base64"),
        ("v1:AAAAAA\u00e9=", "is not valid base64"),
        ("v1:AAAAAAA=", "holds 5 bytes, not a whole number of 4-byte token ids"),
        ("v1:AAAAAAAAAA==", "holds 7 bytes"),
        ("v1:", "prompt is empty"),
        ("v2:AAAAAA==", "version '2' is not read by this instance (it reads 1)"),
        ("AAAAAA==", "must be 'v1:' followed by base64"),
        ("x1:AAAAAA==", "must be 'v1:' followed by base64"),
    ],
)
def test_malformed_values_are_refused_naming_the_field(value: str, message: str) -> None:
    with pytest.raises(ValueError, match="invalid request: ") as e:
        parse_request(COMPLETIONS_PATH, {FIELD: value})
    assert message in str(e.value)
    assert FIELD in str(e.value) or message == "prompt is empty"


@pytest.mark.parametrize("value", [1, [1, 2], {"v": 1}, True])
def test_a_packed_value_must_be_a_string(value: object) -> None:
    with pytest.raises(ValueError, match=f"{FIELD} must be a string"):
        parse_request(COMPLETIONS_PATH, {FIELD: value})


@pytest.mark.parametrize("prompt", [[5], "hi", [[5]]])
def test_both_fields_are_refused(prompt: object) -> None:
    with pytest.raises(ValueError, match=f"give the prompt once: prompt or {FIELD}, not both"):
        parse_request(COMPLETIONS_PATH, {"prompt": prompt, FIELD: prompt_pack.pack([5])})


def test_a_valid_packed_prompt_is_the_prompt() -> None:
    body = parse_request(COMPLETIONS_PATH, {FIELD: prompt_pack.pack([7, 8, 9]), "max_tokens": 2, FIELD + "x": 1})
    assert isinstance(body.prompt, np.ndarray) and body.prompt.tolist() == [7, 8, 9] and body.max_tokens == 2
    assert parse_request(COMPLETIONS_PATH, {"prompt": [7], FIELD: None}).prompt == [7]  # null: not given


def test_the_vocabulary_check_reads_the_array() -> None:
    limits = RequestLimits(vocab_size=1000, max_model_len=64, block_size=16, num_blocks=8)
    limits.check(prompt_pack.unpack(prompt_pack.pack([0, 999]) or ""))
    with pytest.raises(ValueError, match=r"token id 1000 is outside the vocabulary \[0, 1000\)"):
        limits.check(prompt_pack.unpack(prompt_pack.pack([3, 1000, 4]) or ""))
    with pytest.raises(ValueError, match="longer than max_model_len 64"):
        limits.check(prompt_pack.unpack(prompt_pack.pack(list(range(65))) or ""))


def test_the_prompt_digest_of_the_array_is_the_lists() -> None:
    ids = [random.Random(1).randrange(150_000) for _ in range(4096)]
    array = prompt_pack.unpack(prompt_pack.pack(ids) or "")
    assert prompt_digest(array) == prompt_digest(ids)
    assert prompt_digest(array[:4095]) == prompt_digest(ids[:4095])  # a capability names the first num_tokens
    assert prompt_digest(array[::2]) == prompt_digest(ids[::2])  # not contiguous: packed as a list is


def _call(body: dict[str, object]) -> Call:
    http = Request({"type": "http", "method": "POST", "path": COMPLETIONS_PATH, "headers": []})
    return Call(COMPLETIONS_PATH, body, "rid", http, False, parsed=parse_request(COMPLETIONS_PATH, body))


def test_legs_carry_token_ids_packed_only_to_instances_that_read_them() -> None:
    pdserve, foreign = Backend("http://p", packed_ids=prompt_pack.VERSION), Backend("http://v")
    assert reads_packed(pdserve) and not reads_packed(foreign) and not reads_packed(Backend("http://x", packed_ids=2))
    call = _call({"prompt": [[4, 5, 6]], "max_tokens": 3})
    out = leg_body(call, call.body, reads_packed(pdserve))
    assert "prompt" not in out and out["max_tokens"] == 3
    assert prompt_pack.unpack(str(out[FIELD])).tolist() == [4, 5, 6]
    assert parse_request(COMPLETIONS_PATH, out).prompt.tolist() == [4, 5, 6]
    assert leg_body(call, call.body, reads_packed(foreign)) is call.body
    assert call.packed_prompt() is call.packed_prompt()  # packed once for every leg
    text = _call({"prompt": "hello"})
    assert leg_body(text, text.body, True) is text.body
    assert leg_body(text, text.body, True, [1, 2])[FIELD] == prompt_pack.pack([1, 2])  # P's ids of a text prompt
    assert leg_body(text, text.body, False, [1, 2]) == {"prompt": [1, 2]}
    huge = _call({"prompt": [1, 2**40]})  # no vocabulary holds it: the JSON list, for the instance's own 400
    assert leg_body(huge, huge.body, True) is huge.body
