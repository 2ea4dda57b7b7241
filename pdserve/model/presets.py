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


def _gemma3(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, scalar: int
) -> dict[str, Any]:
    """Gemma 3 text decoder (the language model of the 12B/27B checkpoints, as Gemma3ForCausalLM): 5 local
    layers (window 1024, rotary base 1e4) per global one (base 1e6, linear scaling x8)."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "max_position_embeddings": 131072,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "query_pre_attn_scalar": scalar,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 262208,
    }


_PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-12b": _gemma3(hidden=3840, intermediate=15360, layers=48, heads=16, kv_heads=8, head_dim=256, scalar=256),
    "gemma3-27b": _gemma3(hidden=5376, intermediate=21504, layers=62, heads=32, kv_heads=16, head_dim=128, scalar=168),
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
