"""kv_transfer_params at the edge: valid sets round-trip through encode/decode; a missing key or a malformed
value is a KVParamsError (a ValueError) whose message names the key."""

import pytest

from pdserve.kv.decode import decode, decode_answer
from pdserve.kv.params import (
    KVParamsError,
    Mode,
    PullSource,
    PushAnswer,
    PushSource,
    Refusal,
    RemoteDecode,
    encode,
)

PULL = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [0, 1],
        "remote_request_id": "r", "remote_num_tokens": 20, "transfer_mode": "pull"}  # fmt: skip
REMOTE_DECODE = {"do_remote_decode": True, "decode_max_tokens": 8}
PUSH = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": 5600,
        "transfer_mode": "push"}  # fmt: skip

VALUES = [
    RemoteDecode(None, None),
    RemoteDecode(Mode.PUSH, "t1"),
    RemoteDecode(None, None, None, 300),
    PullSource("127.0.0.1", 5600, "p-1", "req-7", (3, 1, 2), 40, 16, 1),
    PullSource("h", 1, None, "r", (), 0, None),
    PushSource("t2", "127.0.0.1", 65535, "p-1", 2),
    PushSource("t3", "h", 5600, None),
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip(value):
    assert decode(encode(value)) == value


@pytest.mark.parametrize("value", [VALUES[3], PushAnswer("t", "p-1"), Refusal("no transfer id")], ids=repr)
def test_answer_round_trip(value):
    assert decode_answer(encode(value)) == value


def test_what_asks_for_no_transfer():
    assert decode(None) is None and decode({}) is None and decode({"do_remote_prefill": False}) is None
    assert decode_answer(None) is None and decode_answer({}) is None


def test_vllm_pull_answer_without_mode_is_a_pull():
    raw = {k: v for k, v in PULL.items() if k != "transfer_mode"}
    assert decode(raw) == PullSource("127.0.0.1", 5600, None, "r", (0, 1), 20, None)
    assert decode(PUSH) == PushSource("t", "127.0.0.1", 5600, None)


# what vLLM 0.32's NixlConnector (pull) answers for a finished prefill: one list of block ids per KV group
VLLM_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5, 6]],
               "remote_engine_id": "e-1", "remote_request_id": "cmpl-1-0", "remote_host": "127.0.0.1",
               "remote_port": 5701, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
               "remote_blocks_expiry_time": None, "transfer_mode": "pull"}  # fmt: skip


def test_vllm_prefill_answer_decodes():
    """pdserve's router checks a vLLM P's answer before relaying it; one KV group is a flat table."""
    assert decode_answer(VLLM_ANSWER) == PullSource("127.0.0.1", 5701, "e-1", "cmpl-1-0", (4, 5, 6), 40, None)


def test_vllm_answer_with_several_kv_groups_is_refused():
    with pytest.raises(KVParamsError, match="^kv_transfer_params.remote_block_ids: vLLM's per-KV-group form with 2"):
        decode_answer(dict(VLLM_ANSWER, remote_block_ids=[[1, 2], [3]]))
    with pytest.raises(KVParamsError, match="block ids in"):
        decode_answer(dict(VLLM_ANSWER, remote_block_ids=[[1, -2]]))


BAD = [
    (PULL, "remote_num_tokens", None, "missing"),
    (PUSH, "transfer_id", None, "missing"),
    (PULL, "remote_port", 70000, r"\[1, 65535\], got 70000"),
    (PUSH, "remote_port", 0, r"\[1, 65535\]"),
    (PULL, "remote_port", "5600", "must be an integer"),
    (PUSH, "remote_port", 5600.0, "must be an integer"),
    (PULL, "remote_port", True, "must be an integer"),
    (PULL, "remote_num_tokens", -1, r"\[0, "),
    (PULL, "remote_num_tokens", 10**30, r"got 1000000"),
    (PULL, "remote_block_ids", [0, -1], "block ids in"),
    (PULL, "remote_block_ids", [0, "1"], "block ids in"),
    (PULL, "remote_block_ids", "0,1", "must be a list"),
    (PULL, "remote_block_ids", list(range((1 << 20) + 1)), "must be a list of at most"),
    (dict(PULL, remote_block_size=4), "remote_block_ids", [0], "1 blocks of 4 tokens cannot hold 20"),
    (PULL, "remote_block_size", 0, r"\[1, "),
    (PULL, "remote_host", "", "1 to 256 characters"),
    (PULL, "remote_host", ["h"], "must be a string"),
    (PULL, "remote_request_id", "x" * 5000, "1 to 1024"),
    (PUSH, "tp_size", 0, r"\[1, 1024\]"),
    (PUSH, "tp_size", -1, r"\[1, 1024\]"),
    (PUSH, "transfer_mode", "teleport", "'pull' or 'push'"),
    (PUSH, "do_remote_prefill", "yes", "true or false"),
    (PUSH, "do_remote_decode", True, "together"),
    (REMOTE_DECODE, "decode_max_tokens", 0, r"\[1, "),
    (REMOTE_DECODE, "decode_max_tokens", "9", "must be an integer"),
    (REMOTE_DECODE, "decode_max_tokens", True, "must be an integer"),
]


@pytest.mark.parametrize("base, key, value, words", BAD, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_value_names_the_key(base, key, value, words):
    raw = {k: v for k, v in base.items() if k != key}
    if value is not None:
        raw[key] = value
    with pytest.raises(KVParamsError, match=f"^kv_transfer_params.{key}: .*{words}") as e:
        decode(raw)
    assert e.value.key == key and isinstance(e.value, ValueError)


def test_not_an_object():
    with pytest.raises(KVParamsError, match="^kv_transfer_params: must be a JSON object"):
        decode([1, 2])
