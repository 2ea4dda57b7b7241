"""The router's tokenizer (tokenizers + jinja2, no transformers) gives the token ids the server's tokenizer gives
(model/tokenizer.py: transformers), for text and chat prompts: the router hashes what the instance caches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.model.tokenizer import Tokenizer
from pdserve.openai_request import ChatCompletionRequest, CompletionRequest
from pdserve.router.prompt_tokens import PromptTokens, max_text_chars
from pdserve.router.tokenizer import RouterTokenizer

TEXTS = ["Hello, world!", "  leading spaces\nand lines\t", "ünïcödé ✓ 中文", "x" * 300]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Question one?"},
        {"role": "assistant", "content": "Answer."},
        {"role": "user", "content": "Ünïcödé follow-up"},
    ],
]


def same_ids(folder: Path) -> None:
    server, router = Tokenizer.from_pretrained(folder), RouterTokenizer(folder)
    for text in TEXTS:
        assert router.encode(text) == server.encode(text), text
    assert router.has_chat_template == server.has_chat_template
    if server.has_chat_template:
        for chat in CHATS:
            assert router.render_chat(chat) == server.render_chat(chat)
            assert router.chat_ids(chat) == server.apply_chat_template(chat)


@pytest.mark.parametrize("add_bos", [True, False])
def test_byte_tokenizer_matches_the_server(
    tmp_path: Path, make_byte_tokenizer: Callable[..., Any], add_bos: bool
) -> None:
    make_byte_tokenizer(add_bos).save_pretrained(tmp_path)
    same_ids(tmp_path)


def test_smollm2_matches_the_server_when_converted() -> None:
    """The built-in model's real template (loops, conditionals, a default system prompt), when its converted
    folder is in this machine's cache (`pdserve serve smollm2-135m` made it)."""
    folders = sorted((Path.home() / ".cache" / "pdserve").glob("smollm2-135m-*/tokenizer.json"))
    if not folders:
        pytest.skip("no converted smollm2-135m folder in ~/.cache/pdserve")
    same_ids(folders[-1].parent)


def test_a_folder_without_tokenizer_json_has_none(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        RouterTokenizer(tmp_path)


def test_truncation_and_padding_in_tokenizer_json_are_dropped_as_transformers_does(
    tmp_path: Path, make_byte_tokenizer: Callable[..., Any]
) -> None:
    make_byte_tokenizer(True).save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {
        "strategy": {"Fixed": 512}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
        "pad_type_id": 0, "pad_token": "<unk>",
    }  # fmt: skip
    path.write_text(json.dumps(spec))
    same_ids(tmp_path)
    assert len(RouterTokenizer(tmp_path).encode("x" * 300)) == 301  # BOS + one token per byte


def test_texts_above_the_cap_are_not_tokenized(tmp_path: Path, make_byte_tokenizer: Callable[..., Any]) -> None:
    """Routed by load instead (prompt_tokens.max_text_chars): the instance refuses such a text anyway."""
    make_byte_tokenizer(False).save_pretrained(tmp_path)
    prompts = PromptTokens(RouterTokenizer(tmp_path), max_chars=100)
    assert prompts.max_chars == 100 and max_text_chars(4096) == 4096 * 64

    def ids(request: Any) -> list[int] | None:
        return asyncio.run(prompts.token_ids(request))

    assert len(ids(CompletionRequest(prompt="y" * 100)) or []) == 100  # one token per byte
    assert ids(CompletionRequest(prompt="y" * 101)) is None
    chat = [{"role": "user", "content": "z" * 40}]
    assert ids(ChatCompletionRequest(messages=chat)) is not None  # 40 characters, 90 rendered
    assert ids(ChatCompletionRequest(messages=chat * 3)) is None  # 120 characters of content
    assert ids(ChatCompletionRequest(messages=[{"role": "user", "content": "z" * 80}])) is None  # 130 rendered
