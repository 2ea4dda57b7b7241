"""A cheap estimate of a request's prompt length in tokens, from its JSON body alone (no tokenizer).

- `/v1/completions` with token ids (`"prompt": [1, 2, 3]`): exact, the list's length; the same ids packed
  (prompt_pack.FIELD, as a client may send them too): exact, from the base64's length (the body was validated).
- Text (a completion prompt, or every chat message's content): UTF-8 bytes / 4, rounded up. BPE tokenizers of
  English text average 3.5-4.5 bytes per token, so this is within ~25% for prose; a byte-level tokenizer (one
  token per byte) is under-estimated 4x, which only shifts the threshold a user picks.
- A batch (`"prompt": ["a", "b"]` or a list of id lists): the longest prompt of the batch.
- Anything else (no prompt, an odd type): None, and the router then disaggregates as usual.
"""

from __future__ import annotations

from typing import Any

from pdserve import prompt_pack

BYTES_PER_TOKEN = 4  # the text estimate's divisor


def text_tokens(text: str) -> int:
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def packed_tokens(value: str) -> int:
    """The number of ids a valid packed prompt (prompt_pack.FIELD's value) holds, from its base64's length alone
    (4 characters per 3 bytes, less the padding; 4 bytes per id)."""
    data = value.partition(":")[2]
    padding = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    return (len(data) // 4 * 3 - padding) // prompt_pack.UINT32_BYTES


def _one_prompt(prompt: Any) -> int | None:
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None


def _content_text(content: Any) -> str:
    """A chat message's content: a string, or a list of parts of which the text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """Estimated prompt tokens of a completions or chat body; None when the body has no recognisable prompt."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            return None
        text = "".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
        return text_tokens(text)
    packed = body.get(prompt_pack.FIELD)
    if isinstance(packed, str):
        return packed_tokens(packed)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        lengths = [_one_prompt(p) for p in prompt]  # a batch of prompts
        return None if any(n is None for n in lengths) else max(n for n in lengths if n is not None)
    return _one_prompt(prompt)
