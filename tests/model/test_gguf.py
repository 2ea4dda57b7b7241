"""The GGUF path: transformers' conversion (q/k un-permuted), the converted-weights cache, the built-in model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from paged_step import PagedCache, step

from pdserve.config import ModelConfig
from pdserve.model import loader
from pdserve.model.loader import gguf_cache_folder, load_model

TINY_GGUF_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    *sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet()),
    "Ġt",
    "hi",
]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row order (interleaved rotary halves) that transformers undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf: Any, path: Path) -> None:
    """Write a transformers Llama model as an F32 GGUF the way llama.cpp does, with a byte-level tokenizer."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tokens = TINY_GGUF_TOKENS + [f"<extra_{i}>" for i in range(c.vocab_size - len(TINY_GGUF_TOKENS))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3 = control, 1 = normal
    w.add_token_merges(["Ġ t", "h i"])  # transformers refuses a BPE without merges (and reads one as a string)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names["mlp.down_proj"] = "ffn_down"
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf_name, gguf_name in names.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", sd[p + hf_name + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], Any], tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_gguf(hf_reference("llama"), path)
    return path


def test_gguf_matches_transformers_and_is_cached(
    tiny_gguf: Path, hf_reference: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m = load_model(ModelConfig(model=str(tiny_gguf)))
    assert m.name == "tiny-llama.F32" and m.arch.num_kv_heads == 2
    ids = list(range(5, 45))
    (ours,) = step(m.decoder, PagedCache(m.arch, num_blocks=16, block_size=4), [(0, ids)], use_decode_batch=False)
    with torch.no_grad():
        expected = hf_reference("llama")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)  # q/k rows un-permuted correctly

    folder = gguf_cache_folder(tiny_gguf, "tiny-llama.F32")
    assert folder.parent == tmp_path / "pdserve"
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left behind
    # the tokenizer keeps the GGUF's BOS/EOS metadata
    assert m.tokenizer is not None and m.tokenizer.eos_token_ids == (2,)
    expected_ids = [TINY_GGUF_TOKENS.index(t) for t in ("hi", "Ġt")]
    assert m.tokenizer.encode("hi t") == expected_ids  # no BOS (add_bos_token is false); the merges apply
    assert m.tokenizer.decode(expected_ids) == "hi t"

    def no_conversion(path: Path, out: Path) -> None:
        raise AssertionError("converted again although the cache holds this file")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    again = load_model(ModelConfig(model=str(tiny_gguf)))
    assert torch.equal(again.decoder.layers[1].qkv_proj.weight, m.decoder.layers[1].qkv_proj.weight)

    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a changed file: new cache key
    with pytest.raises(AssertionError, match="converted again"):
        load_model(ModelConfig(model=str(tiny_gguf)))
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # the failed attempt left nothing


@pytest.mark.slow
def test_builtin_decoder_greedy_answers_paris() -> None:
    """SmolLM2-135M-Instruct from its Q4_1 GGUF: a hand-driven greedy loop over the Decoder says Paris."""
    m = load_model(ModelConfig(model="smollm2-135m"))
    assert m.tokenizer is not None and m.arch.num_layers == 30 and m.arch.tie_word_embeddings
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = m.tokenizer.apply_chat_template(question)
    cache = PagedCache(m.arch, num_blocks=8, block_size=16)
    logits = step(m.decoder, cache, [(0, ids)], use_decode_batch=False)[0][-1]
    answer: list[int] = []
    while len(answer) < 32:
        answer.append(int(logits.argmax()))
        if answer[-1] in m.tokenizer.eos_token_ids:
            break
        logits = step(m.decoder, cache, [(0, answer[-1:])])[0][-1]
    text = m.tokenizer.decode(answer)
    assert "Paris" in text, text
