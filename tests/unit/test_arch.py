"""ModelArch.from_hf_config: config.json as written by transformers 4.x and 5.x."""

import pytest

from pdserve.config import ConfigError
from pdserve.model.arch import ModelArch

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def test_transformers4_rope_fields():
    arch = ModelArch.from_hf_config({**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3})
    assert arch.rope_theta == 5e5 and dict(arch.rope_scaling)["factor"] == 8.0


def test_transformers5_rope_parameters():
    arch = ModelArch.from_hf_config({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert arch.rope_theta == 5e5 and dict(arch.rope_scaling)["factor"] == 8.0
    plain = ModelArch.from_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        ModelArch.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_family_flags():
    assert ModelArch.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias
    q3 = ModelArch.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32


def test_gemma3_rope_parameters_per_layer_type_as_transformers_5_writes_them() -> None:
    """transformers >= 5 writes Gemma 3's rotary settings per layer type under rope_parameters."""
    from pdserve.model.arch import ModelArch

    base = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
    }  # fmt: skip
    v4 = ModelArch.from_hf_config(
        {
            **base,
            "rope_theta": 10000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    )
    v5 = ModelArch.from_hf_config(
        {**base, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        }}
    )  # fmt: skip
    assert v5.local_rope_theta == v4.local_rope_theta == 100.0
    assert v5.rope_theta == v4.rope_theta == 10000.0
    assert dict(v5.rope_scaling or ())["factor"] == dict(v4.rope_scaling or ())["factor"] == 2.0
