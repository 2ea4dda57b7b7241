"""Shared fixtures: tiny random Hugging Face model folders (one per supported family and variant).

Every model is built locally from a transformers config (hidden 64, 2 layers, vocab 320) with random weights,
saved with save_pretrained together with a tiny byte-level tokenizer; nothing touches the network.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_VOCAB = 320  # model vocabulary; the tokenizer uses the first 261 ids
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4


def build_byte_tokenizer(add_bos: bool, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A byte-level BPE tokenizer without merges (one token per UTF-8 byte) in a PreTrainedTokenizerFast.

    Ids 0-4 are <unk>, <s> (BOS), </s> (EOS), <|im_start|>, <|im_end|>; ids 5-260 are the 256 bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


def _tiny_configs() -> dict[str, tuple[Any, bool]]:
    """name -> (transformers config, tokenizer adds BOS)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    llama3_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # small, so head_dim 16 has scaled, smoothed and kept bands
    }
    return {
        "llama": (LlamaConfig(**common), True),
        "llama3": (LlamaConfig(**{**common, "rope_theta": 500000.0}, rope_scaling=llama3_scaling), True),
        "llama_tied": (LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=True), True),
        "mistral": (MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None), True),
        "qwen2": (Qwen2Config(**common, tie_word_embeddings=False), False),
        "qwen3": (Qwen3Config(**common, head_dim=32, tie_word_embeddings=False), False),
        # sliding windows, as transformers builds them from these configs (prompts of the tests run past them):
        # every layer sees the last 10 keys (2.5 blocks of 4)
        "mistral_swa": (MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=10), True),
        # layer 0 full, layer 1 the last 7 keys
        "qwen2_swa": (Qwen2Config(**common, use_sliding_window=True, sliding_window=7, max_window_layers=1), False),
        # local, global, local, global (pattern 2); its own norms, GELU-tanh, embedding scale, q/k norms,
        # query_pre_attn_scalar, local rotary base 100 vs global 10000 with linear scaling, logit softcapping
        "gemma3": (
            Gemma3TextConfig(
                **{**common, "num_hidden_layers": 4},
                head_dim=16,
                sliding_window=6,
                sliding_window_pattern=2,
                query_pre_attn_scalar=24,
                rope_local_base_freq=100.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
                final_logit_softcapping=5.0,
            ),
            True,
        ),
    }


TINY_FAMILIES = list(_tiny_configs())  # parametrize over these names


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 0.1^2) (biases included), norm weights ~ 1 + N(0, 0.1^2): no parameter is trivial."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * 0.1
        p.copy_(noise + 1.0 if "norm" in name else noise)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family name -> folder with config.json, model.safetensors and tokenizer files."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {}
    for i, (name, (config, add_bos)) in enumerate(_tiny_configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)
        _randomize(model, seed=i)
        model.save_pretrained(root / name)
        build_byte_tokenizer(add_bos).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs: dict[str, Path]) -> Callable[[str], Any]:
    """family name -> the transformers model of that folder (float32, eval), loaded once per session."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[name], dtype=torch.float32)
            cache[name] = model.eval()
        return cache[name]

    return get


@pytest.fixture(params=TINY_FAMILIES)
def tiny_family(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over every tiny model family (see tiny_model_dirs)."""
    return str(request.param)


@pytest.fixture(scope="session")
def make_byte_tokenizer() -> Callable[..., Any]:
    """build_byte_tokenizer(add_bos, chat_template=...) for tests that need a tokenizer without a model."""
    return build_byte_tokenizer
