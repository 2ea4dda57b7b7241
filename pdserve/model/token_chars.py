"""An upper bound on the characters of text one token can stand for, read from a tokenizer's own structure.

The server refuses a text prompt longer than `max_model_len * bound` characters before tokenizing it (a 28.6 MB
prompt cost 37 s of tokenizer CPU before its "longer than max_model_len" 400). No legal prompt may be refused,
so the bound must hold for every text, and it does when the tokenizer never drops or fuses characters:

- every token stands for a substring of the text after normalization and pre-tokenization whose length is at
  most its own string's: a vocabulary entry as the model stores it (byte-level BPE: one character per byte,
  never fewer characters than the text it decodes to; SentencePiece: "▁" for a space), an added token's
  content, or one character (an unknown character that is not fused with its neighbours, a byte-fallback byte).
  So a text of c characters after normalization has at least c / L tokens, L the longest such string;
- normalization may shorten a text only by canonical composition, which merges at most 4 code points into one
  (the longest canonical decomposition in Unicode is 4 code points, U+1FAF; NFKC's compatibility mappings only
  lengthen), so the text before normalization has at most 4 times as many characters: bound = 4 * L.

A prompt of more than `max_model_len * 4 * L` characters therefore has more than max_model_len tokens, which is
refused anyway. Tokenizers whose structure can drop or fuse characters get no bound (None: every prompt is
tokenized): normalizers that strip (Strip, StripAccents, BertNormalizer, SentencePiece's Precompiled charsmap,
a Replace whose content is empty or whose pattern is longer than one character), pre-tokenizers that remove
what they split on (Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, a Split or Punctuation
with behavior "Removed"), models that fuse unknown runs into one token (BPE with fuse_unk and no byte fallback,
Unigram without byte fallback, WordPiece, WordLevel), added tokens that swallow whitespace (lstrip/rstrip), and
slow (non-`tokenizers`) tokenizers. The tiny byte-level tokenizer of the tests gets L = 12 ("<|im_start|>").

Pure Python (json): the server's request path imports it and loads no torch.
"""

from __future__ import annotations

import json
from typing import Any

MAX_COMPOSITION = 4  # code points canonical composition merges into one, at most (unicodedata: max NFD length)

_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence"}


def max_chars_per_token(hf_tokenizer: Any) -> int | None:
    """4 * the longest token string of a transformers fast tokenizer, or None when its structure could make
    one token stand for any number of characters (module docstring)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: nothing to inspect
    spec = json.loads(backend.to_str())
    if not (_normalizer_keeps_chars(spec.get("normalizer")) and _pre_tokenizer_keeps_chars(spec.get("pre_tokenizer"))):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = _longest_model_token(spec.get("model") or {}, _has_byte_level(spec.get("pre_tokenizer")))
    if longest is None:
        return None
    longest = max([longest, 1, *(len(t.get("content", "")) for t in added)])
    return MAX_COMPOSITION * longest


def _normalizer_keeps_chars(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind not in _SAFE_NORMALIZERS:
        return False
    if kind == "Sequence":
        return all(_normalizer_keeps_chars(n) for n in node.get("normalizers", []))
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        return len(pattern.get("String", "")) == 1 and bool(node.get("content"))
    return True


def _pre_tokenizer_keeps_chars(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind not in _SAFE_PRE_TOKENIZERS:
        return False
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_chars(n) for n in node.get("pretokenizers", []))
    return node.get("behavior") != "Removed"


def _has_byte_level(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(n) for n in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"


def _byte_level_alphabet() -> set[str]:
    """The 256 characters a ByteLevel pre-tokenizer maps bytes to (GPT-2's: printable bytes stand for
    themselves, the others for code points from 256 up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = set(map(chr, keep)), 0
    for b in range(256):
        if b not in keep:
            out.add(chr(256 + extra))
            extra += 1
    return out


def _longest_model_token(model: dict[str, Any], byte_level: bool) -> int | None:
    """The longest vocabulary entry, or None for a model that fuses unknown characters into one token or drops
    them (BPE with neither an unknown token nor byte fallback emits nothing for a character it does not know,
    unless a byte-level pre-tokenizer feeds it only characters its vocabulary holds)."""
    kind = model.get("type")
    if kind == "BPE":
        if model.get("fuse_unk") and not model.get("byte_fallback") and model.get("unk_token") is not None:
            return None
        if model.get("unk_token") is None and not model.get("byte_fallback"):
            if not (byte_level and _byte_level_alphabet() <= set(model.get("vocab", {}))):
                return None
        return max((len(t) for t in model.get("vocab", {})), default=1)
    if kind == "Unigram":
        if not model.get("byte_fallback"):
            return None
        return max((len(piece[0]) for piece in model.get("vocab", [])), default=1)
    return None  # WordPiece, WordLevel (an unknown word of any length is one token), or unknown
