"""model/token_chars.py: the characters-per-token bound is an upper bound where it is given, and absent where a
tokenizer can fold any number of characters into one token."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve.model.token_chars import MAX_COMPOSITION, max_chars_per_token


def fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def bpe(**kw: Any) -> Tokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "▁": 4, "<0x41>": 5}
    return Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>", **kw))


def test_the_bound_holds_for_hostile_texts(make_byte_tokenizer: Callable[..., Any]) -> None:
    """No text has more characters than bound * its token count: whitespace runs, combining marks that NFC
    composes, Hangul jamo, special-token strings, random code points."""
    hf = make_byte_tokenizer(add_bos=False)
    with_nfc = make_byte_tokenizer(add_bos=False)
    with_nfc.backend_tokenizer.normalizer = normalizers.NFKC()
    rng = random.Random(0)
    texts = [
        " " * 500, "\n\t " * 100, "e\u0301" * 200, "\u1100\u1161\u11a8" * 100, "\u0391\u0314\u0342\u0345" * 50,
        "<|im_start|>" * 40, "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(400)).encode(
            "utf-8", "ignore").decode("utf-8", "ignore"),
    ]  # fmt: skip
    for tok in (hf, with_nfc):
        bound = max_chars_per_token(tok)
        assert bound is not None
        for text in texts:
            assert len(text) <= bound * len(tok(text, add_special_tokens=False)["input_ids"]), text[:20]


def test_structures_that_fold_characters_have_no_bound() -> None:
    plain = bpe(byte_fallback=True, fuse_unk=True)
    assert max_chars_per_token(fast(plain)) == MAX_COMPOSITION * len("<0x41>")
    assert max_chars_per_token(fast(bpe(fuse_unk=True))) is None  # a run of unknown characters is one token
    stripping = [
        normalizers.Strip(),
        normalizers.StripAccents(),
        normalizers.BertNormalizer(),
        normalizers.Replace(" ", ""),
        normalizers.Sequence([normalizers.NFC(), normalizers.Strip()]),
    ]
    for norm in stripping:
        tok = bpe()
        tok.normalizer = norm
        assert max_chars_per_token(fast(tok)) is None, norm
    for pre in (pre_tokenizers.Whitespace(), pre_tokenizers.WhitespaceSplit(), pre_tokenizers.BertPreTokenizer(),
                pre_tokenizers.Split(" ", "removed")):  # fmt: skip
        tok = bpe()
        tok.pre_tokenizer = pre
        assert max_chars_per_token(fast(tok)) is None, pre
    tok = bpe()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Split(" ", "isolated")])
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    assert max_chars_per_token(fast(tok)) == MAX_COMPOSITION * len("<0x41>")
    wordpiece = Tokenizer(models.WordPiece({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    assert max_chars_per_token(fast(wordpiece)) is None


@pytest.mark.parametrize("flag", ["lstrip", "rstrip"])
def test_added_tokens_that_swallow_whitespace_have_no_bound(flag: str) -> None:
    from tokenizers import AddedToken

    tok = bpe()
    tok.add_special_tokens([AddedToken("<mask>", **{flag: True})])
    assert max_chars_per_token(fast(tok)) is None


def test_bpe_that_drops_unknown_characters_has_no_bound_unless_byte_level_covers_every_byte() -> None:
    """A BPE with neither an unknown token nor byte fallback emits nothing for a character it does not know: a
    long text of such characters has few tokens, so no bound (review of issue 26, item 6); behind a byte-level
    pre-tokenizer whose vocabulary holds all 256 byte characters nothing is unknown, and the bound stays."""
    no_unk = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    assert max_chars_per_token(fast(no_unk)) is None
    text = "\u4e00" * 300 + "ab"
    assert len(no_unk.encode(text).ids) == 1  # the 300 unknown characters are dropped: why no bound
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert max_chars_per_token(fast(byte_level)) == MAX_COMPOSITION * len("<unk>")  # (fast() adds it)
    partial = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet[:200])}, merges=[]))
    partial.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert max_chars_per_token(fast(partial)) is None
