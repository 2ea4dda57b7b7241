"""The pull router in front of vLLM-shaped instances: P's answer reaches D verbatim (vLLM's per-KV-group block
lists and keys pdserve does not model included), and an answer pdserve cannot check is a 502 naming the key.

Two small HTTP servers play vLLM 0.32's NixlConnector P and D at the HTTP level (the KV itself moves between
two vLLM engines, which `make interop` runs for real: scripts/interop_vllm.py); D echoes the params it got.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from helpers import Launcher, post

pytestmark = [pytest.mark.e2e]

# vLLM 0.32's answer for a finished prefill (kv_transfer/kv_connector/v1/nixl/pull_scheduler.py)
VLLM_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7, 8]],
               "remote_engine_id": "vllm-p", "remote_request_id": "cmpl-1-0", "remote_host": "127.0.0.1",
               "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 200,
               "remote_blocks_expiry_time": None, "transfer_mode": "pull"}  # fmt: skip


class _VllmShaped(ThreadingHTTPServer):
    """As P: answers `answer` as kv_transfer_params; as D: answers with the kv_transfer_params it received."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer = answer  # None: a decode instance
        self.seen: list[Any] = []  # the kv_transfer_params of every completion request
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _VllmShaped

    def _json(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._json({"status": "ok"})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        params = request.get("kv_transfer_params")
        self.server.seen.append(params)
        answer = self.server.answer if self.server.answer is not None else params
        choice = {"index": 0, "text": "ok", "finish_reason": "length"}
        self._json({"id": "cmpl-1", "object": "text_completion", "choices": [choice], "kv_transfer_params": answer})

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving(answer: dict[str, Any] | None) -> Iterator[_VllmShaped]:
    server = _VllmShaped(answer)
    threading.Thread(target=server.serve_forever, name="vllm-shaped", daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def vllm_d() -> Iterator[_VllmShaped]:
    with serving(None) as server:
        yield server


def test_vllm_prefill_answer_reaches_decode_verbatim(launcher: Launcher, vllm_d: _VllmShaped) -> None:
    with serving(VLLM_ANSWER) as vllm_p:
        router = launcher.proxy("pull", [vllm_p.url], [vllm_d.url])
        launcher.wait_ready()
        resp = post(router.url, "/v1/completions", {"prompt": list(range(200)), "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        # decode_max_tokens is pdserve's (P refuses early); vLLM 0.32's NixlConnector reads its keys with .get
        assert vllm_p.seen == [{"do_remote_decode": True, "decode_max_tokens": 4}]
        assert vllm_d.seen == [VLLM_ANSWER]  # nested block ids, dcp_size, expiry: untouched
        assert resp.json()["kv_transfer_params"] == VLLM_ANSWER


def test_vllm_answer_with_several_kv_groups_is_502(launcher: Launcher, vllm_d: _VllmShaped) -> None:
    with serving(dict(VLLM_ANSWER, remote_block_ids=[[7, 8], [9]])) as vllm_p:
        router = launcher.proxy("pull", [vllm_p.url], [vllm_d.url])
        launcher.wait_ready()
        resp = post(router.url, "/v1/completions", {"prompt": list(range(200)), "max_tokens": 4})
        assert resp.status_code == 502
        message = resp.json()["error"]["message"]
        assert "remote_block_ids" in message and "2 groups" in message and vllm_p.url in message, message
        assert vllm_d.seen == []  # no decode leg for an answer the router cannot check
