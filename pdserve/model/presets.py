"""Shape presets: Hugging Face config.json dicts with the published numbers, for `load_format="dummy"`.

A preset carries no weights and no tokenizer; with dummy weights the engine takes token-id prompts only.
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.config import ConfigError


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    """Qwen3 dense family: head_dim 128, 8 KV heads, qk norm, rope_theta 1e6, 40960 positions."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "max_position_embeddings": 40960,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    }


_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _qwen3(hidden=1024, intermediate=3072, layers=28, heads=16, tie=True),
    "qwen3-1.7b": _qwen3(hidden=2048, intermediate=6144, layers=28, heads=16, tie=True),
    "qwen3-8b": _qwen3(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False),
    "qwen3-32b": _qwen3(hidden=5120, intermediate=25600, layers=64, heads=64, tie=False),
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,  # the base model's; the Instruct model adds 128008 and 128009
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
}


def preset_names() -> list[str]:
    """Names of every shape preset, sorted."""
    return sorted(_PRESETS)


def is_preset(name: str) -> bool:
    """True when `name` is a shape preset."""
    return name in _PRESETS


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config.json dict; ConfigError listing the known names otherwise."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown shape preset {name!r}; known presets: {', '.join(preset_names())}")
    return copy.deepcopy(_PRESETS[name])
