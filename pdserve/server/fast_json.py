"""Request bodies parsed by pydantic-core's JSON parser instead of the standard library's.

A prompt of 16k token ids is ~100 KB of JSON, parsed on the first token's path by every instance it reaches (P,
then D in pull mode). pydantic-core parses it in about half the time json.loads takes, with the same result for
every JSON document (duplicate keys: the last wins; NaN and Infinity are read, then refused by the request
models). A body that is not JSON raises json.JSONDecodeError, as json.loads would, so FastAPI's "json_invalid"
error and our 400 for it (server/api.py) stay as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


class FastJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError as e:  # not JSON, not UTF-8, or nested deeper than the parser allows
                raise _decode_error(str(e), body.decode("utf-8", "replace")) from None
        return self._json


_WHERE = re.compile(r"^(.*) at line (\d+) column (\d+)$")


def _decode_error(message: str, doc: str) -> json.JSONDecodeError:
    """json.JSONDecodeError for pydantic-core's "<what> at line L column C" (its position as a character offset)."""
    m = _WHERE.match(message)
    if m is None:
        return json.JSONDecodeError(message, doc, 0)
    line, column = int(m.group(2)), int(m.group(3))
    lines = doc.split("\n")
    pos = sum(len(x) + 1 for x in lines[: line - 1]) + max(0, column - 1)
    return json.JSONDecodeError(m.group(1), doc, min(pos, len(doc)))


class FastJSONRoute(APIRoute):
    """An APIRoute whose handlers get a FastJSONRequest (`APIRouter(route_class=FastJSONRoute)`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return route
