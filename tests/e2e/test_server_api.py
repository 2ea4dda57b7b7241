"""`pdserve serve` as a real process (tiny random Llama, --kv-role both): the OpenAI API, errors, metrics,
and a client that disconnects."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
from helpers import Launcher, Proc, joined_stream, post, scrape_metrics, stream_events, wait_idle, wait_log_status

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
NUM_BLOCKS = 64
METRIC_NAMES = [
    "pdserve_kv_blocks_total",
    "pdserve_kv_blocks_free",
    "pdserve_requests_running",
    "pdserve_requests_waiting",
    "pdserve_requests_waiting_for_kv",
    "pdserve_kv_prepared_writes",
    "pdserve_kv_sent_bytes_total",
    "pdserve_kv_received_bytes_total",
    'pdserve_kv_transfers_total{result="ok"}',
    'pdserve_kv_transfers_total{result="failed"}',
    'pdserve_kv_transfers_total{result="expired"}',
    "pdserve_time_to_first_token_seconds_count",
    "pdserve_time_to_first_token_seconds_bucket",
    "pdserve_kv_transfer_seconds_count",
    "pdserve_kv_transfer_seconds_bucket",
    "pdserve_requests_started_total",
    "pdserve_prompt_tokens_total",
    "pdserve_prefix_cache_hit_tokens_total",
]
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(launcher: Launcher, tiny_llama: Path) -> Proc:
    proc = launcher.serve(tiny_llama, "--kv-role", "both", "--num-gpu-blocks", str(NUM_BLOCKS), name="server")
    launcher.wait_ready()
    return proc


def test_health_models_info(server: Proc) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "llama" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    info = httpx.get(server.url + "/kv_transfer/info").json()
    assert info["kv_role"] == "both" and info["block_size"] == 16


def test_completion(server: Proc) -> None:
    request_id = f"test-{uuid.uuid4().hex}"
    resp = post(server.url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 7, **GREEDY}, {
        "X-Request-Id": request_id
    })  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == request_id
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == "llama"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 7
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7
    timeline = httpx.get(server.url + "/timeline").json()
    assert any(t["client_request_id"] == request_id and t["request_id"] != request_id for t in timeline)


def test_prompt_forms_agree(server: Proc) -> None:
    """A string, its token ids, and one-element lists of either give the same greedy answer."""
    first = post(server.url, "/v1/completions", {"prompt": "abc def", "max_tokens": 5, **GREEDY}).json()
    ids = first["choices"][0]["prompt_token_ids"]
    for prompt in (ids, [ids], ["abc def"]):
        again = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 5, **GREEDY}).json()
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_default_max_tokens_is_16(server: Proc) -> None:
    body = post(server.url, "/v1/completions", {"prompt": "x", "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_equals_non_stream(server: Proc, path: str) -> None:
    body = {"max_tokens": 12, **GREEDY}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "The quick brown fox"})
    whole = post(server.url, path, body).json()
    choice = whole["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    payloads = stream_events(server.url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert joined_stream(payloads) == (text, choice["token_ids"], "length")
    usage = payloads[-1]["usage"]
    assert payloads[-1]["choices"] == [] and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    if "chat" in path:
        assert payloads[0]["object"] == "chat.completion.chunk"
        assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, ["no-such-model"]),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, ["temperature"]),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, ["top_p"]),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, ["n"]),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, ["one prompt"]),
        ("/v1/completions", {"prompt": [5, 100000]}, 400, ["100000"]),
        ("/v1/completions", {"max_tokens": 3}, 400, ["prompt"]),
        ("/v1/completions", {"prompt": "a" * 300}, 400, ["301", str(MAX_MODEL_LEN)]),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, 400, ["300", str(MAX_MODEL_LEN)]),
        ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "model": "x"}, 404, ["x"]),
    ],
)
def test_bad_requests(server: Proc, path: str, body: dict, status: int, words: list[str]) -> None:
    resp = post(server.url, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["type"]
    for word in words:
        assert word in error["message"], error["message"]


def test_malformed_json_is_400(server: Proc) -> None:
    headers = {"content-type": "application/json"}
    resp = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', headers=headers)
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


def test_metrics_names(server: Proc) -> None:
    post(server.url, "/v1/completions", {"prompt": "metrics", "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    m = scrape_metrics(server.url)
    assert m["pdserve_kv_blocks_total"] == NUM_BLOCKS
    assert m["pdserve_time_to_first_token_seconds_count"] >= 1
    assert "# TYPE pdserve_kv_transfers_total counter" in text
    assert "# TYPE pdserve_kv_blocks_free gauge" in text
    assert "# TYPE pdserve_time_to_first_token_seconds histogram" in text
    # a prompt of 40 token ids sent twice: the second time 2 of its 16-token blocks come from the prefix cache
    prompt = [3 + (11 * i) % 200 for i in range(40)]
    before = wait_idle(server.url)
    for _ in range(2):
        assert post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **GREEDY}).status_code == 200
    after = wait_idle(server.url)
    delta = {
        k: after[f"pdserve_{k}_total"] - before[f"pdserve_{k}_total"]
        for k in ("requests_started", "prompt_tokens", "prefix_cache_hit_tokens")
    }
    assert delta == {"requests_started": 2, "prompt_tokens": 80, "prefix_cache_hit_tokens": 32}, delta


def test_stream_disconnect_aborts_and_frees_blocks(server: Proc) -> None:
    request_id = f"gone-{uuid.uuid4().hex}"
    body = {"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_log_status(server, request_id) == "499"  # aborted, not finished
    m = wait_idle(server.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == NUM_BLOCKS


def test_non_stream_disconnect_aborts_and_frees_blocks(server: Proc) -> None:
    request_id = f"gone-{uuid.uuid4().hex}"
    body = json.dumps({"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head.encode() + body)
        time.sleep(0.05)  # the request is running (it needs ~250 decode steps)
    assert wait_log_status(server, request_id) == "499"
    m = wait_idle(server.url)
    assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == NUM_BLOCKS


def test_openai_client(server: Proc) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    comp = client.completions.create(model="llama", prompt="Once upon", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop") and comp.usage is not None
    chunks = list(
        client.completions.create(model="llama", prompt="Once upon", max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    chat = client.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llama", prompt="x", max_tokens=1, temperature=-1)
