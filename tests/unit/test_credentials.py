"""credentials.py / web.RoleAuth: which key opens which route, in every combination of keys (the table in
credentials.py's docstring), and that a request showing the internal credential is marked."""

from __future__ import annotations

import argparse

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pdserve.credentials import Credentials, add_internal_key_arguments, credentials_from
from pdserve.web import is_internal_caller, protect

CLIENT, INTERNAL = "client-key-0123", "internal-key-4567"
PATHS = ["/health", "/v1/models", "/v1/completions", "/metrics", "/timeline", "/kv_transfer/info",
         "/kv_transfer/release", "/kv_events", "/docs"]  # fmt: skip


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"internal": is_internal_caller(request)})


def client_for(credentials: Credentials) -> TestClient:
    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST"]) for p in PATHS])
    protect(app, credentials, 1 << 20)
    return TestClient(app)


def status(client: TestClient, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.get(path, headers=headers).status_code


@pytest.mark.parametrize(
    "credentials, opens",
    [
        # both keys: the client key opens the client routes only; the internal key opens everything
        (Credentials(CLIENT, INTERNAL), {None: ["/health"], CLIENT: ["/health", "/v1/models", "/v1/completions",
                                         "/metrics"], INTERNAL: PATHS}),
        (Credentials(CLIENT, INTERNAL, metrics_internal=True), {CLIENT: ["/health", "/v1/models", "/v1/completions"],
                                                                INTERNAL: PATHS}),
        # only the client key (as before roles): it opens everything
        (Credentials(CLIENT, None), {None: ["/health"], CLIENT: PATHS, INTERNAL: ["/health"]}),
        # only the internal key: client routes are open, internal ones need it
        (Credentials(None, INTERNAL), {None: ["/health", "/v1/models", "/v1/completions", "/metrics"],
                                       INTERNAL: PATHS}),
    ],
)  # fmt: skip
def test_route_roles(credentials: Credentials, opens: dict[str | None, list[str]]) -> None:
    client = client_for(credentials)
    for key, allowed in opens.items():
        for path in PATHS:
            expected = 200 if path in allowed else 401
            assert status(client, path, key) == expected, (key, path)


def test_internal_callers_are_marked_and_refusals_say_why() -> None:
    client = client_for(Credentials(CLIENT, INTERNAL))
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {INTERNAL}"}).json() == {"internal": True}
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {CLIENT}"}).json() == {"internal": False}
    resp = client.get("/timeline", headers={"Authorization": f"Bearer {CLIENT}"})
    assert resp.json()["error"]["type"] == "authentication_error"
    assert "internal API key (the client key does not open it)" in resp.json()["error"]["message"]


def test_key_flags(tmp_path: object) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    add_internal_key_arguments(parser, is_router=False)
    path = tmp_path / "internal"  # type: ignore[operator]
    path.write_text(INTERNAL + "\n")
    creds = credentials_from(parser.parse_args(["--api-key", CLIENT, "--internal-api-key-file", str(path)]))
    assert (creds.client_key, creds.internal_key, creds.upstream_key) == (CLIENT, INTERNAL, INTERNAL)
    for argv, words in (
        (["--api-key", "k1234", "--internal-api-key", "k1234"], "must differ"),
        (["--internal-metrics"], "--internal-metrics needs --internal-api-key"),
        (["--internal-api-key", "x", "--internal-api-key-file", str(path)], "give --internal-api-key once"),
        (["--internal-api-key", " "], "empty"),
    ):
        with pytest.raises(ValueError, match=words):
            credentials_from(parser.parse_args(argv))
