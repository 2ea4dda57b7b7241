"""kv_transfer_params as D parses them: a missing key and a malformed value each get a message that says which."""

import pytest

from pdserve.transfer.pull import PullParams
from pdserve.transfer.push_recv import PushParams

PULL = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [0, 1],
        "remote_request_id": "r", "remote_num_tokens": 20, "transfer_mode": "pull"}  # fmt: skip
PUSH = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": 5600,
        "transfer_mode": "push"}  # fmt: skip


@pytest.mark.parametrize("cls, params", [(PullParams, PULL), (PushParams, PUSH)], ids=["pull", "push"])
def test_valid_params_parse(cls, params):
    assert cls.parse(params).port == 5600


MISSING = [(PullParams, PULL, "remote_num_tokens"), (PushParams, PUSH, "transfer_id")]


@pytest.mark.parametrize("cls, params, key", MISSING, ids=["pull", "push"])
def test_missing_key_is_named(cls, params, key):
    mode = params["transfer_mode"]
    with pytest.raises(ValueError, match=f"^kv_transfer_params lack '{key}' for a {mode}$"):
        cls.parse({k: v for k, v in params.items() if k != key})


@pytest.mark.parametrize("cls, params", [(PullParams, PULL), (PushParams, PUSH)], ids=["pull", "push"])
def test_malformed_value_is_shown(cls, params):
    mode = params["transfer_mode"]
    with pytest.raises(ValueError, match=f"malformed value for a {mode}: .*'not-a-port'"):
        cls.parse(dict(params, remote_port="not-a-port"))
    with pytest.raises(ValueError, match=f"malformed value for a {mode}: "):
        cls.parse(dict(params, remote_port=None))
