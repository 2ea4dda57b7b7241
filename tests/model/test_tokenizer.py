"""Tokenizer wrapper (BOS convention, eos ids, chat template) and the streaming IncrementalDetokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.config import ModelConfig
from pdserve.model.loader import load_model
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Héllo, wörld! 日本語 🎉 done"


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, prompt_ids: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids or [])
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def test_bos_follows_the_model_convention(tiny_model_dirs: dict[str, Path]) -> None:
    llama = load_model(ModelConfig(model=str(tiny_model_dirs["llama"]))).tokenizer
    qwen = load_model(ModelConfig(model=str(tiny_model_dirs["qwen3"]))).tokenizer
    assert llama is not None and qwen is not None
    assert llama.encode("hi")[0] == 1 and len(llama.encode("hi")) == 3
    assert qwen.encode("hi") == llama.encode("hi")[1:]
    assert llama.decode(llama.encode(TEXT)) == TEXT
    assert llama.decode(llama.encode(TEXT), skip_special_tokens=False) == "<s>" + TEXT
    assert llama.vocab_size == 261


def test_eos_ids_are_the_union_of_tokenizer_and_config(
    make_byte_tokenizer: Callable[..., Any], tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    assert Tokenizer(make_byte_tokenizer(True), extra_eos_token_ids=[4, 2]).eos_token_ids == (2, 4)
    # generation_config.json's eos list (as Llama 3 Instruct ships it) joins config.json's
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "eos_token_id": 3})
    )
    tok = load_model(ModelConfig(model=str(folder))).tokenizer
    assert tok is not None and tok.eos_token_ids == (2, 3, 4)


def test_chat_template(make_byte_tokenizer: Callable[..., Any]) -> None:
    tok = Tokenizer(make_byte_tokenizer(True))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 3  # <|im_start|>: the template's text, no BOS added on top


def test_no_chat_template_is_a_clear_error(make_byte_tokenizer: Callable[..., Any]) -> None:
    tok = Tokenizer(make_byte_tokenizer(True, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_detokenizer_holds_back_split_characters(make_byte_tokenizer: Callable[..., Any], chunk: int) -> None:
    """Byte tokens split every non-ASCII character; no delta may carry a half character (U+FFFD)."""
    tok = Tokenizer(make_byte_tokenizer(False))
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters really are split
    deltas = _stream(tok, ids, chunk)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing left to flush


def test_detokenizer_skips_special_tokens_and_flushes(make_byte_tokenizer: Callable[..., Any]) -> None:
    tok = Tokenizer(make_byte_tokenizer(False))
    prompt = tok.encode("Q: ")
    ids = tok.encode("A é") + [2]  # EOS at the end
    assert "".join(_stream(tok, ids, prompt_ids=prompt)) == "A é"
    truncated = tok.encode("ok 日")[:-1]  # generation stopped inside a character
    deltas = _stream(tok, truncated)
    assert "".join(deltas[:-1]) == "ok " and deltas[-1] == "\ufffd"


def test_detokenizer_keeps_sentencepiece_spaces() -> None:
    """Metaspace tokenizers drop the leading space of a decode's first token; deltas must keep it."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "▁Hello", "▁world", "▁again", "!"]
    raw = RawTokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>"))
    assert tok.decode([3]) == "world"  # the pitfall: alone, the space is gone
    deltas = _stream(tok, [3, 4, 5], prompt_ids=[2])
    assert deltas[:3] == [" world", " again", "!"]


@pytest.mark.slow
def test_detokenizer_on_the_builtin_tokenizer() -> None:
    """SmolLM2's byte-level BPE: streamed text equals a one-shot decode, emoji and CJK included."""
    from pdserve.model.builtin import builtin_gguf_path
    from pdserve.model.loader import gguf_to_folder

    tok = Tokenizer.from_pretrained(gguf_to_folder(builtin_gguf_path("smollm2-135m"), "smollm2-135m"), [2])
    ids = tok.encode(TEXT + " Ünïcödé ✓")
    assert tok.bos_token_id == 1 and ids[0] != 1  # SmolLM2 adds no BOS (GGUF add_bos_token = false)
    assert tok.eos_token_ids == (2,)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == TEXT + " Ünïcödé ✓"
    assert not any("\ufffd" in d for d in deltas)
