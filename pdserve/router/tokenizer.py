"""The router's copy of the served model's tokenizer: text and chat prompts to the token ids an instance computes,
so their blocks can be hashed as the instance hashes them (router/kv_route.py).

The router never imports torch, and `transformers` imports torch as soon as it is imported, so this reads the
Hugging Face folder itself: `tokenizer.json` through the `tokenizers` library (what a transformers *fast*
tokenizer runs, post-processor and BOS included), the chat template and special tokens from
`tokenizer_config.json` (or `chat_template.jinja` / `special_tokens_map.json`), rendered with jinja2 in the
environment transformers builds for `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, loop
controls, its `tojson`, `raise_exception` and `strftime_now`; the special tokens as variables). The server does
`render_chat` then `encode(add_special_tokens=False)` for chat, and `encode(add_special_tokens=True)` for text
(model/tokenizer.py, server/prepare.py); so does this, with truncation and padding off as transformers loads
it. tests/router/test_router_tokenizer.py checks it against the server's tokenizer. A folder without
tokenizer.json (a slow, sentencepiece-only tokenizer) gives no tokenizer: its text prompts are routed by load
alone. A wrong token id only costs a prefix miss, never a wrong answer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class RouterTokenizer:
    """A model folder's fast tokenizer and chat template, without transformers (module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        """Raises FileNotFoundError when the folder has no tokenizer.json, ValueError when it cannot be read."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self.folder = folder  # where it was loaded from, for the log
        try:
            self._tok = Tokenizer.from_file(str(path))
            self._tok.no_truncation()  # tokenizer.json may carry them; transformers' fast tokenizer drops both
            self._tok.no_padding()
            config = _read_json(folder / "tokenizer_config.json")
            special = {**config, **_read_json(folder / "special_tokens_map.json")}
        except Exception as e:  # tokenizers raises its own Exception type on a bad file
            raise ValueError(f"cannot read the tokenizer in {folder}: {e}") from e
        self._special: dict[str, Any] = {  # template variables, as transformers' special_tokens_map
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(special.get(name))) is not None
        }
        extra = special.get("additional_special_tokens")
        if isinstance(extra, list):
            self._special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        self._template_source = _chat_template(folder, config)
        self._template: Any = None  # compiled on first use

    @property
    def has_chat_template(self) -> bool:
        return self._template_source is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`. Through encode_batch, which releases the GIL while it works (single-text encode
        holds it: a 64 KB text stalled the router's event loop ~100 ms from its worker thread); same ids."""
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat followed by the assistant's turn header, as transformers' apply_chat_template(tokenize=False,
        add_generation_prompt=True) writes it; ValueError without a template."""
        if self._template_source is None:
            raise ValueError(f"the tokenizer in {self.folder} has no chat template")
        if self._template is None:
            self._template = _compile(self._template_source)
        return str(
            self._template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **self._special
            )
        )

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)  # the template wrote any BOS


def _compile(source: str) -> Any:
    """The template in the environment transformers' chat_template_utils._compile_jinja_template builds."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
