"""Text <-> token ids around a Hugging Face tokenizer, and streaming detokenization.

Dummy-weight presets have no tokenizer (LoadedModel.tokenizer is None); the engine then takes token-id
prompts only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.model.token_chars import max_chars_per_token

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer:
    """A Hugging Face tokenizer plus the model's end-of-sequence ids."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer  # a transformers PreTrainedTokenizer(Fast)
        eos = set(int(i) for i in extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))  # tokenizer eos + config eos, sorted
        self.vocab_size: int = len(hf_tokenizer)  # base vocabulary + added tokens
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    @classmethod
    def from_pretrained(cls, folder: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face model folder (the class AutoTokenizer would pick).

        A folder whose tokenizer_config.json names the generic PreTrainedTokenizerFast (and no remote code) is
        loaded with that class directly: AutoTokenizer would pick the same class, but importing it imports
        transformers' model registry and torch._dynamo with it (~2 s of CPU at every start)."""
        if _names_generic_fast_class(Path(folder)):
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(folder)), extra_eos_token_ids)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder)), extra_eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens (BOS or none) the model's tokenizer adds by itself unless
        `add_special_tokens` is False (a rendered chat template writes them itself)."""
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the characters one token stands for, or None (model/token_chars.py)."""
        return max_chars_per_token(self.hf)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens (EOS, chat markers) are dropped unless asked for."""
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.hf, "chat_template", None) is not None

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The text of a chat ([{"role": ..., "content": ...}, ...]) followed by the assistant's turn header, as the
        model's chat template writes it (special tokens included: encode it with add_special_tokens=False)."""
        if not self.has_chat_template:
            raise ValueError(
                f"tokenizer {getattr(self.hf, 'name_or_path', '')!r} has no chat template; "
                "send a plain prompt (/v1/completions) instead of chat messages"
            )
        return str(self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat followed by the assistant's turn header (render_chat, then encode)."""
        # the template writes any BOS itself, so the tokenizer must not add one again
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _names_generic_fast_class(folder: Path) -> bool:
    """Whether `folder`'s tokenizer_config.json names PreTrainedTokenizerFast without an auto_map: the one case
    where AutoTokenizer.from_pretrained is PreTrainedTokenizerFast.from_pretrained (transformers 4.57)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") == "PreTrainedTokenizerFast"
        and "auto_map" not in config
    )


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, one `add` call per engine step.

    Decodes a small window (a few already-emitted tokens + the new ones) rather than the whole sequence,
    so tokenizers that drop a leading space at the start of a decode still produce the right delta; text
    ending in U+FFFD (a multi-byte character split across tokens) is held back until it completes.
    """

    PREFIX_WINDOW = 5  # prompt tokens decoded as left context for the first output token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.PREFIX_WINDOW :])  # left context + generated ids
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] = already emitted context
        self.read_offset = len(self.ids)  # ids[read_offset:] = not yet emitted
        self.text = ""  # every delta returned so far, concatenated

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete: wait for more ids
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever text was held back (incomplete characters included)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
