"""A fake instance on loopback for router tests that need a backend to misbehave in one exact way.

    with StubBackend(info=lambda: {...}, answer=lambda path: (500, error_payload(500, "boom"))) as stub:
        router = launcher.proxy("push", [stub.url], [d.url])

GET /kv_transfer/info answers `info()`, any other GET {"status": "ok"}; every POST is read whole and answered
`answer(path)` after `delay_s`. `num_legs` counts POSTs to /v1/completions (not the router's releases).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ERROR_TYPES = {403: "permission_error", 500: "internal_server_error"}


def error_payload(status: int, message: str) -> dict[str, Any]:
    """An instance's error body (OpenAI's shape)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "code": status}}


class _Handler(BaseHTTPRequestHandler):
    server: StubBackend

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._json(200, self.server.info() if self.path == "/kv_transfer/info" else {"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.num_legs += self.path == "/v1/completions"
        time.sleep(self.server.delay_s)
        self._json(*self.server.answer(self.path))

    def log_message(self, *args: object) -> None:
        pass


class StubBackend(ThreadingHTTPServer):
    """Serves on a thread from construction until the `with` block (or close()) ends."""

    def __init__(
        self,
        info: Callable[[], dict[str, Any]],
        answer: Callable[[str], tuple[int, dict[str, Any]]],
        delay_s: float = 0.0,
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.info, self.answer, self.delay_s = info, answer, delay_s
        self.num_legs = 0
        self._thread = threading.Thread(target=self.serve_forever, name="stub-backend", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()

    def __enter__(self) -> StubBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
