"""A request's prompt as the token ids an instance will compute, when the router can know them exactly.

- `/v1/completions` with token ids: the ids themselves (what `pdserve bench` sends; no tokenizer needed);
- text, or a chat: with the router's tokenizer (router/tokenizer.py), encoded as the server encodes it
  (server/prepare.py), in a worker thread (a long prompt takes milliseconds to tokenize);
- otherwise (no tokenizer, no chat template, a template that fails): None, and the request is routed by load
  alone (router/kv_route.py), with its length estimated from bytes where a length is needed (prompt_len.py).

The tokenizer comes from `--tokenizer FOLDER`, or else from the `root` the first decode (colocated: first)
instance reports in GET /v1/models when that is a folder on the router's machine holding tokenizer.json; it is
loaded once, in a worker thread, once that instance answers /v1/models (`load`). A built-in model's root is its
name, not a folder: pass --tokenizer for it (or send token ids). A text (a rendered chat) longer than
max_model_len x MAX_CHARS_PER_TOKEN characters is not tokenized (the instance refuses it anyway): routed by
load. Tokenizing runs in a worker thread through `encode_batch`, which releases the GIL.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.openai_request import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.prompt_pack import to_list
from pdserve.router.kv_route import PromptKeys
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.upstream import LegError, get_json

log = logging.getLogger(__name__)

MAX_TOKEN_ID = 2**63 - 1  # kv/block_hashes.py hashes token ids as int64
MAX_CHARS_PER_TOKEN = 64  # a generous bound (4 x a 16-character token; the server computes its own, model/)
FALLBACK_MAX_MODEL_LEN = 131_072  # tokens, when the instance does not say its max_model_len


def max_text_chars(max_model_len: int | None) -> int:
    """Characters of text (a prompt, a rendered chat) above which the router does not tokenize it: such a text
    has more tokens than max_model_len, so the instance refuses it anyway, and tokenizing ~1 MB costs seconds of
    CPU. Routed by load instead; a bound too low would only cost a prefix miss."""
    return (max_model_len or FALLBACK_MAX_MODEL_LEN) * MAX_CHARS_PER_TOKEN


class PromptTokens:
    """Prompt token ids of validated requests, with the router's tokenizer when it has one."""

    def __init__(self, tokenizer: RouterTokenizer | None, max_chars: int = max_text_chars(None)) -> None:
        self.tokenizer = tokenizer  # None: text and chat prompts are not hashed
        self.max_chars = max_chars  # longer texts are not tokenized (max_text_chars)

    async def keys(self, request: SamplingFields | None) -> PromptKeys | None:
        """The prompt's block keys to come, or None: routed by load (module docstring). Token ids beyond int64
        (the hash scheme's width) are None too: no vocabulary holds them, so the instance answers its 400."""
        ids = await self.token_ids(request)
        if ids is None or (ids and max(ids) > MAX_TOKEN_ID):
            return None
        return PromptKeys(ids)

    async def token_ids(self, request: SamplingFields | None) -> list[int] | None:
        if isinstance(request, CompletionRequest):
            if not isinstance(request.prompt, str):  # a list, or (a client sending the packed form) an array
                return to_list(request.prompt)
            if self.tokenizer is not None and len(request.prompt) <= self.max_chars:
                return await asyncio.to_thread(self._encode, request.prompt)
        elif isinstance(request, ChatCompletionRequest) and self.tokenizer is not None:
            if self.tokenizer.has_chat_template:
                messages = [{"role": m.role, "content": m.text()} for m in request.messages]
                if sum(len(m["content"]) for m in messages) <= self.max_chars:
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
            text = self.tokenizer.render_chat(messages)
            if len(text) > self.max_chars:
                return None
            return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS
        except Exception as e:  # a template that raises on these messages: the instance answers the 400
            log.debug("cannot render a chat (%s): routed by load", e)
            return None


async def load(
    tokenizer: str | None, first_instance: str, session: aiohttp.ClientSession, timeout_s: float, retry_s: float
) -> PromptTokens:
    """The router's PromptTokens, once the first instance answers GET /v1/models (asked again every `retry_s`;
    the router routes by load meanwhile): its max_model_len bounds the text tokenized (max_text_chars); the
    tokenizer is `--tokenizer` when given (an unusable one is logged and ignored), else the folder the instance
    reports, when it holds a tokenizer on this machine."""
    while True:
        try:
            models = await get_json(session, "decode", first_instance, "/v1/models", timeout_s)
            break
        except LegError as e:  # not up yet
            log.debug("no /v1/models from %s yet (%s)", first_instance, e)
            await asyncio.sleep(retry_s)
    try:
        card = models["data"][0]
        root, max_model_len = card.get("root"), card.get("max_model_len")
    except (KeyError, IndexError, TypeError, AttributeError):
        root = max_model_len = None
    max_chars = max_text_chars(max_model_len if isinstance(max_model_len, int) and max_model_len > 0 else None)
    folder = tokenizer if tokenizer is not None else root
    if tokenizer is None and (not isinstance(folder, str) or not (Path(folder) / "tokenizer.json").is_file()):
        log.info(
            "the instances' model %r is not a tokenizer folder on this machine: text prompts are routed by load "
            "(token-id prompts by cache and load); give --tokenizer FOLDER to hash text too",
            folder,
        )
        return PromptTokens(None)
    try:
        loaded = await asyncio.to_thread(RouterTokenizer, str(folder))
    except (OSError, ValueError) as e:
        log.error("cannot load the tokenizer in %s: %s; text prompts are routed by load", folder, e)
        return PromptTokens(None)
    log.info(
        "tokenizer from %s: text and chat prompts up to %d characters are hashed as the instances hash them",
        folder, max_chars,
    )  # fmt: skip
    return PromptTokens(loaded, max_chars)
