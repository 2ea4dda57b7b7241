"""A request's prompt as the token ids an instance will compute, when the router can know them exactly.

- `/v1/completions` with token ids: the ids themselves (what `pdserve bench` sends; no tokenizer needed);
- text, or a chat: with the router's tokenizer (router/tokenizer.py), encoded as the server encodes it
  (server/prepare.py), in a worker thread (a long prompt takes milliseconds to tokenize);
- otherwise (no tokenizer, no chat template, a template that fails): None, and the request is routed by load
  alone (router/kv_route.py), with its length estimated from bytes where a length is needed (prompt_len.py).

The tokenizer comes from `--tokenizer FOLDER`, or else from the `root` the first decode (colocated: first)
instance reports in GET /v1/models when that is a folder on the router's machine holding tokenizer.json; it is
loaded once, in a worker thread, at the router's start (`load`). A built-in model's root is its name, not a
folder: pass --tokenizer for it (or send token ids).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.openai_request import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.router.kv_route import PromptKeys
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.upstream import LegError, get_json

log = logging.getLogger(__name__)

MAX_TOKEN_ID = 2**63 - 1  # kv/block_hashes.py hashes token ids as int64


class PromptTokens:
    """Prompt token ids of validated requests, with the router's tokenizer when it has one."""

    def __init__(self, tokenizer: RouterTokenizer | None) -> None:
        self.tokenizer = tokenizer  # None: text and chat prompts are not hashed

    async def keys(self, request: SamplingFields | None) -> PromptKeys | None:
        """The prompt's block keys to come, or None: routed by load (module docstring). Token ids beyond int64
        (the hash scheme's width) are None too: no vocabulary holds them, so the instance answers its 400."""
        ids = await self.token_ids(request)
        if ids is None or (ids and max(ids) > MAX_TOKEN_ID):
            return None
        return PromptKeys(ids)

    async def token_ids(self, request: SamplingFields | None) -> list[int] | None:
        if isinstance(request, CompletionRequest):
            if isinstance(request.prompt, list):
                return list(request.prompt)
            if self.tokenizer is not None:
                return await asyncio.to_thread(self._encode, request.prompt)
        elif isinstance(request, ChatCompletionRequest) and self.tokenizer is not None:
            if self.tokenizer.has_chat_template:
                messages = [{"role": m.role, "content": m.text()} for m in request.messages]
                return await asyncio.to_thread(self._chat, messages)
        return None

    def _encode(self, text: str) -> list[int] | None:
        assert self.tokenizer is not None
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except Exception as e:  # the instance will refuse or tokenize it; routing needs no answer
            log.debug("cannot tokenize a prompt (%s): routed by load", e)
            return None

    def _chat(self, messages: list[dict[str, Any]]) -> list[int] | None:
        assert self.tokenizer is not None
        try:
            return self.tokenizer.chat_ids(messages)
        except Exception as e:  # a template that raises on these messages: the instance answers the 400
            log.debug("cannot render a chat (%s): routed by load", e)
            return None


async def load(
    tokenizer: str | None, first_instance: str, session: aiohttp.ClientSession, timeout_s: float, retry_s: float
) -> PromptTokens:
    """The router's PromptTokens: `--tokenizer` when given (an unusable one is logged and ignored), else the
    folder the instance reports (asked again every `retry_s` until it answers), when it holds a tokenizer on
    this machine."""
    folder = tokenizer
    while folder is None:
        try:
            models = await get_json(session, "decode", first_instance, "/v1/models", timeout_s)
        except LegError as e:  # not up yet: the router routes by load meanwhile
            log.debug("no /v1/models from %s yet (%s)", first_instance, e)
            await asyncio.sleep(retry_s)
            continue
        try:
            folder = models["data"][0]["root"]
        except (KeyError, IndexError, TypeError):
            folder = None
        if not isinstance(folder, str) or not (Path(folder) / "tokenizer.json").is_file():
            log.info(
                "the instances' model %r is not a tokenizer folder on this machine: text prompts are routed by load "
                "(token-id prompts by cache and load); give --tokenizer FOLDER to hash text too",
                folder,
            )
            return PromptTokens(None)
    try:
        loaded = await asyncio.to_thread(RouterTokenizer, folder)
    except (OSError, ValueError) as e:
        log.error("cannot load the tokenizer in %s: %s; text prompts are routed by load", folder, e)
        return PromptTokens(None)
    log.info("tokenizer from %s: text and chat prompts are hashed as the instances hash them", folder)
    return PromptTokens(loaded)
