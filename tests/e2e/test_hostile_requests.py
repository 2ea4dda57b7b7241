"""Hostile request bodies against a real instance and a real router: every one is a 400 with an OpenAI error
naming the problem, never a 500 or a dead instance, and the router refuses each before any prefill leg.

The bodies are generated (hostile(): ~650 to the instance, ~620 to the router): each field of both endpoints
with values of the wrong type, out of range, non-finite or of an option pdserve does not implement, `stream`
on and off in turn; plus raw bodies that are not a JSON object at all. The router runs in pull
mode with its prefill instance at a dead URL: a body it passed on would be a 502 naming the prefill leg.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from helpers import Launcher, Proc

from pdserve.bench.procs import free_ports
from pdserve.openai_request import CHAT_PATH, COMPLETIONS_PATH, MAX_STOP, UNSUPPORTED
from pdserve.prompt_pack import FIELD, HEALTH_KEY, VERSION, pack
from pdserve.router.health import HealthMonitor
from pdserve.router.policy import Backend, Pool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
NAN, INF = float("nan"), float("inf")
CHAT = [{"role": "user", "content": "hi"}]
GOOD = [  # (path, body) answered 200; each hostile body is one of these with one field made bad
    (COMPLETIONS_PATH, {"prompt": "hi", "max_tokens": 2}),
    (COMPLETIONS_PATH, {"prompt": [5, 6, 7], "max_tokens": 2}),
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 2}),
]

NOT_INT = [True, False, 1.0, 2.5, "1", [], {}, NAN, INF]
NOT_FLOAT = [NAN, INF, -INF, True, "0.5", [], {}]
NOT_BOOL = ["false", "true", 0, 1, "yes", [], {}]
# field -> values every instance and the router must refuse, on both endpoints
BAD_FIELDS: dict[str, list[Any]] = {
    "max_tokens": [*NOT_INT, 0, -1],
    "top_k": [*NOT_INT, -2, -(2**64)],
    "seed": [*NOT_INT, 2**63, -(2**63) - 1, 2**100],
    "n": [*NOT_INT, 0, 2, -1],
    "temperature": [*NOT_FLOAT, -0.5, -1e-9, 1e309],
    "top_p": [*NOT_FLOAT, 0, -0.1, 1.5],
    "stream": NOT_BOOL,
    "ignore_eos": NOT_BOOL,
    "return_token_ids": NOT_BOOL,
    "stream_options": ["x", 1, [], {"include_usage": "yes"}, {"include_usage": 1}],
    "stop": [1, True, "", [""], [1], [None], [["a"]], {"a": 1}, ["a"] * (MAX_STOP + 1)],
    "stop_token_ids": [1, "1", [-1], [True], [1.5], ["1"], [None], list(range(MAX_STOP + 1))],
    "model": [1, True, [], {}],
    "kv_transfer_params": ["x", 1, [1]],
}
# refused by the instance, which knows its model; the router passes them on (it replaces kv_transfer_params)
INSTANCE_ONLY: dict[str, list[Any]] = {
    "max_tokens": [MAX_MODEL_LEN, 2**64],
    "kv_transfer_params": [{"do_remote_prefill": "yes"}, {"do_remote_prefill": True, "remote_block_ids": "x"}],
}
BAD_COMPLETION = {
    "prompt": [1, True, 1.5, [], [True], [1.5], [-1], ["a", "b"], [[1], [2]], [[]], [[True]], {"a": 1},
              ],
    "echo": [True, 1, "no"],
    "suffix": ["x", 1],
    "logprobs": [0, 1, True, 5],
    "best_of": [2, 0, True, "1"],
}  # fmt: skip
BAD_CHAT = {
    "messages": [[], "hi", 1, {}, [1], [None], [{"content": "x"}], [{"role": "bob", "content": "x"}],
                 [{"role": "", "content": "x"}], [{"role": 1, "content": "x"}], [{"role": ["user"], "content": "x"}],
                 [{"role": "user", "content": 1}], [{"role": "user", "content": [1]}],
                 [{"role": "user", "content": {"text": "x"}}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"text": "x"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 1}]}]],
    "max_completion_tokens": [*NOT_INT, 0],
    "logprobs": [True, 1, "false"],
}  # fmt: skip


def _not_neutral(neutral: Any) -> list[Any]:
    """Values of an unsupported option that ask for it (UNSUPPORTED maps each option to its neutral value)."""
    if isinstance(neutral, bool):
        return [not neutral, 1]
    if isinstance(neutral, int | float):
        return [neutral + 0.5, neutral + 1, True, "0"]
    if isinstance(neutral, str):
        return ["auto", 1]
    if isinstance(neutral, dict):
        return [{"x": 1}, {"type": "json_object"}, "x"]
    return [[1], [{"type": "function", "function": {"name": "f"}}], "x"]


def _instance_only(path: str) -> dict[str, list[Any]]:
    if path == COMPLETIONS_PATH:
        return {**INSTANCE_ONLY, "prompt": [[10**6], [2**64], "a" * (MAX_MODEL_LEN + 1)]}
    too_long = [{"role": "user", "content": "a" * MAX_MODEL_LEN}]
    return {**INSTANCE_ONLY, "max_completion_tokens": [MAX_MODEL_LEN], "messages": [too_long]}


def hostile(instance: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, body) pairs that the router refuses with 400, and with `instance` those only an instance does."""
    unsupported = {name: _not_neutral(neutral) for name, neutral in UNSUPPORTED.items()}
    for path, good in GOOD:
        fields = [BAD_FIELDS, unsupported, BAD_COMPLETION if path == COMPLETIONS_PATH else BAD_CHAT]
        if instance:
            fields.append(_instance_only(path))
        for field, values in ((f, v) for table in fields for f, v in table.items()):
            # `stream` alternates: each field is refused streaming and not (one bad value: sent both ways)
            turns = [(v, i % 2 == 1) for i, v in enumerate(values)] + ([(values[0], True)] if len(values) == 1 else [])
            for value, stream in turns:
                body = {**good, "stream": stream, field: value}
                if field == "max_tokens" and path == CHAT_PATH:
                    body.pop("max_completion_tokens", None)
                yield path, body
        yield path, {k: v for k, v in good.items() if k not in ("prompt", "messages")}  # no prompt at all


RAW = [
    (b"", "application/json"),
    (b"{", "application/json"),
    (b'{"prompt": "hi",', "application/json"),
    (b"[]", "application/json"),
    (b'"prompt"', "application/json"),
    (b"1", "application/json"),
    (b"null", "application/json"),
    (b"\xff\xfe{}", "application/json"),
    (b'{"prompt": "\xff"}', "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "application/json"),
    (b'{"prompt": "hi"}', "text/plain"),
    (b'{"prompt": "hi"}', ""),
    (b"prompt=hi", "application/x-www-form-urlencoded"),
    (b'{"prompt": "hi"}', "multipart/form-data; boundary=x"),
]
NUM_HOSTILE = sum(1 for _ in hostile(instance=True))


@pytest.fixture(scope="module")
def server(launcher: Launcher, tiny_llama: Path) -> Proc:
    proc = launcher.serve(tiny_llama, "--kv-role", "both", "--num-gpu-blocks", "64", name="server")
    launcher.wait_ready()
    return proc


@pytest.fixture(scope="module")
def router(launcher: Launcher, server: Proc) -> Proc:
    """Pull mode; its prefill instance is a dead URL, so anything it does not refuse itself is a 502."""
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    proc = launcher.proxy("pull", [dead], [server], "--connect-timeout-s", "2", ready_statuses=(200, 503))
    launcher.wait_ready()
    return proc


def refusal_problem(resp: httpx.Response, status: int = 400) -> str | None:
    """What is wrong with `resp` as a refusal: not `status`, or not an OpenAI error with a message."""
    if resp.status_code != status:
        return f"status {resp.status_code}: {resp.text[:200]}"
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {resp.text[:200]}"
    if error.get("code") != status or not isinstance(error.get("message"), str) or not error["message"]:
        return f"bad error body: {error}"
    return None


def send_all(url: str, instance: bool) -> list[str]:
    """Every hostile body and raw body to `url`; the problems found (empty: all refused properly)."""
    problems = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for path, body in hostile(instance):
            content = json.dumps(body).encode()  # NaN and Infinity as Python's json writes them
            resp = client.post(path, content=content, headers={"content-type": "application/json"})
            if (problem := refusal_problem(resp)) is not None:
                problems.append(f"{path} {content[:150]!r}: {problem}")
        for path in (COMPLETIONS_PATH, CHAT_PATH):
            for content, content_type in RAW:
                headers = {"content-type": content_type} if content_type else {}
                resp = client.post(path, content=content, headers=headers)
                if (problem := refusal_problem(resp)) is not None:
                    problems.append(f"{path} {content[:60]!r} ({content_type}): {problem}")
    return problems


def serves(url: str) -> bool:
    return all(httpx.post(url + path, json=body, timeout=60).status_code == 200 for path, body in GOOD)


def test_instance_refuses_every_hostile_body_and_still_serves(server: Proc) -> None:
    assert serves(server.url)
    problems = send_all(server.url, instance=True)
    assert not problems, f"{len(problems)} of {NUM_HOSTILE + 2 * len(RAW)}:\n" + "\n".join(problems[:40])
    assert server.popen.poll() is None and serves(server.url)


def test_router_refuses_before_the_prefill_leg(router: Proc) -> None:
    """A 400 from the router itself: the dead prefill instance would make anything passed on a 502."""
    problems = send_all(router.url, instance=False)
    assert not problems, f"{len(problems)} of {NUM_HOSTILE + 2 * len(RAW)}:\n" + "\n".join(problems[:40])
    assert router.popen.poll() is None
    answer = httpx.post(router.url + COMPLETIONS_PATH, json=GOOD[0][1], timeout=60)
    assert answer.status_code == 502 and "prefill" in answer.json()["error"]["message"]  # a good one is passed on


NEUTRAL_FIELDS = {
    **UNSUPPORTED,
    "n": 1,
    "seed": -(2**63),
    "temperature": 0,
    "top_p": 1,
    "top_k": -1,
    "stop": None,
    "ignore_eos": None,
    "stream_options": None,
    "max_tokens": None,
    "model": "llama",
    "kv_transfer_params": None,
}


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
def test_neutral_values_and_nulls_are_accepted(server: Proc, path: str) -> None:
    extra = {"echo": False, "suffix": None, "logprobs": None} if path == COMPLETIONS_PATH else {"logprobs": False}
    prompt = {"prompt": "hi"} if path == COMPLETIONS_PATH else {"messages": CHAT, "max_completion_tokens": 3}
    resp = httpx.post(server.url + path, json={**prompt, **NEUTRAL_FIELDS, **extra, "unknown_field": 1}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_refusal_names_the_field(server: Proc) -> None:
    cases = {
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 10}},
        "temperature": {"temperature": NAN},
        "seed": {"seed": 2**63},
        "max_tokens": {"max_tokens": True},
        "stream": {"stream": "false"},
        "stop": {"stop": ["a"] * (MAX_STOP + 1)},
        "tools": {"tools": [{"type": "function"}]},
    }
    for name, fields in cases.items():
        content = json.dumps({"prompt": "hi", **fields})
        resp = httpx.post(
            server.url + COMPLETIONS_PATH, content=content, headers={"content-type": "application/json"}, timeout=30
        )
        assert refusal_problem(resp) is None and name in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 2**62},
        {"seed": -(2**63), "temperature": 1e-300},
        {"seed": 2**63 - 1, "top_p": 5e-324},
        {"stop_token_ids": [2**64, 0]},
        {"stop": ["x" * 10_000] * 8},
        {"max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True},
    ],
)
def test_extreme_valid_values_are_served(server: Proc, fields: dict[str, Any]) -> None:
    resp = httpx.post(server.url + COMPLETIONS_PATH, json={"prompt": "hi", "max_tokens": 3, **fields}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert "error" not in resp.text


PACKED_BAD = [  # the router's packed prompt (prompt_pack.FIELD), malformed: 400 naming the problem, never a 500
    {FIELD: "v1:AAA"},  # truncated
    {FIELD: "v1:AAAAAAA="},  # 5 bytes: not whole 4-byte ids
    {FIELD: "v1:!!!!"},
    {FIELD: "v1:"},
    {FIELD: "v9:AAAAAA=="},
    {FIELD: "AAAAAA=="},
    {FIELD: 5},
    {FIELD: [5]},
    {FIELD: pack([5]), "prompt": [5]},  # both
    {FIELD: pack([5]), "prompt": "hi"},
]


def test_packed_prompts_are_served_as_their_json_list_and_refused_when_malformed(server: Proc, router: Proc) -> None:
    ids = [5, 6, 7, 300, 9]
    plain = {"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    packed = {**{k: v for k, v in plain.items() if k != "prompt"}, FIELD: pack(ids)}
    a, b = (httpx.post(server.url + COMPLETIONS_PATH, json=body, timeout=60) for body in (plain, packed))
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["token_ids"] == b.json()["choices"][0]["token_ids"]
    assert b.json()["choices"][0]["prompt_token_ids"] == ids and b.json()["usage"] == a.json()["usage"]
    problems = []
    for url, instance in ((server.url, True), (router.url, False)):
        bad = PACKED_BAD + ([{FIELD: pack([10**6])}] if instance else [])  # past the tiny vocabulary
        for body in bad:
            resp = httpx.post(url + COMPLETIONS_PATH, json={**body, "max_tokens": 2}, timeout=60)
            if (problem := refusal_problem(resp)) is not None:
                problems.append(f"{url} {body}: {problem}")
    assert not problems, "\n".join(problems)
    assert server.popen.poll() is None and serves(server.url)


def test_health_says_the_instance_reads_packed_prompts(server: Proc) -> None:
    """What the router's health check reads (router/health.py) to send an instance packed ids from then on."""
    assert httpx.get(server.url + "/health", timeout=30).json()[HEALTH_KEY] == VERSION

    async def check() -> Backend:
        pool = Pool("decode", [server.url])
        async with aiohttp.ClientSession() as session:
            await HealthMonitor([pool], session, 1.0, 30.0).check(pool, pool.backends[0])
        return pool.backends[0]

    assert asyncio.run(check()).packed_ids == VERSION
