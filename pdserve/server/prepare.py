"""From a validated request body to what the engine takes: prompt token ids and SamplingParams.

Everything here raises ApiError(400, reason) for input the engine must not see. A text prompt (a chat: its
rendered template) longer than `max_chars` characters is refused before it is tokenized: `max_chars` is
max_model_len times the tokenizer's bound on characters per token (model/token_chars.py), so such a prompt has
more tokens than max_model_len and would be refused after tokenizing anyway, only later and at a CPU cost.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pdserve.openai_request import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.prompt_pack import TokenArray
from pdserve.sampling_params import SamplingParams
from pdserve.server.protocol import ApiError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

log = logging.getLogger(__name__)


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON can carry and UTF-8
    cannot): the tokenizer would fail on it with its own TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{what} is not valid Unicode: lone surrogate {text[e.start]!r} at character {e.start}"
        ) from None


def check_chars(text: str, max_chars: int | None, max_model_len: int, what: str) -> None:
    """Refuse text of more than max_chars characters before tokenizing it (the module docstring says why no
    legal prompt is refused)."""
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(
            400,
            f"{what} has {len(text)} characters, more than any prompt under max_model_len {max_model_len} tokens "
            f"can have with this tokenizer ({max_chars})",
        )


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # checked above for what we know of; say no more than that to the client
        log.warning("tokenizer failed on a prompt of %d characters: %s: %s", len(text), type(e).__name__, e)
        raise ApiError(400, "prompt cannot be tokenized by this model's tokenizer") from e


def completion_prompt_ids(
    body: CompletionRequest, tokenizer: Any | None, max_chars: int | None = None, max_model_len: int = 0
) -> list[int] | TokenArray:
    """Token ids of the one prompt of a completion request (text is checked, then tokenized here); the router's
    packed ids stay the array they were unpacked into (prompt_pack.py)."""
    prompt = body.prompt
    if isinstance(prompt, np.ndarray):
        return prompt  # not empty, read-only, in [0, 2**32); the engine checks the vocabulary
    if isinstance(prompt, list):
        return list(prompt)  # not empty, integers >= 0 (openai_request.py); the engine checks the vocabulary
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer (dummy weights): send the prompt as token ids")
    check_chars(prompt, max_chars, max_model_len, "prompt")
    check_text(prompt, "prompt")
    ids = _encode(tokenizer, prompt, add_special_tokens=True)
    if not ids:
        raise ApiError(400, "prompt is empty")
    return ids


def chat_prompt_ids(
    body: ChatCompletionRequest, tokenizer: Any | None, max_chars: int | None = None, max_model_len: int = 0
) -> list[int]:
    """Token ids of the chat rendered by the model's chat template, ending with the assistant's turn header."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer (dummy weights): chat is not available")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    for i, m in enumerate(messages):
        check_text(m["content"], f"messages[{i}].content")
    try:
        text = tokenizer.render_chat(messages)
    except ValueError as e:  # no chat template
        raise ApiError(400, str(e)) from e
    except Exception as e:  # a template that raises on these messages (jinja's own exceptions)
        raise ApiError(400, f"chat template failed on these messages: {e}") from e
    check_chars(text, max_chars, max_model_len, "the chat as its template renders it")
    return _encode(tokenizer, text, add_special_tokens=False)  # the template wrote any BOS itself


def check_output_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse (400) an explicit max_tokens that does not fit beside the prompt. Also P's check of the decode
    leg's max_tokens (kv_transfer_params' decode_max_tokens), so the prefill is not spent on a request D refuses."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} is longer than max_model_len {max_model_len}",
        )


def sampling_params(
    body: SamplingFields, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int | None
) -> SamplingParams:
    """SamplingParams for this body. `default_max_tokens` None = as many as fit in max_model_len.

    A prompt of max_model_len tokens or more is refused with both numbers; an explicit max_tokens that does
    not fit beside the prompt is refused too, while a default one is cut to what fits.
    """
    if num_prompt_tokens >= max_model_len:
        raise ApiError(
            400,
            f"prompt has {num_prompt_tokens} tokens, longer than max_model_len {max_model_len} allows"
            " (at least one token must be left for the output)",
        )
    room = max_model_len - num_prompt_tokens
    requested = body.requested_max_tokens
    if requested is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    else:
        check_output_fits(num_prompt_tokens, requested, max_model_len)
        max_tokens = requested
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from e
