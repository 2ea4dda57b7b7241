"""A tensor-parallel rank reads only its slices of a safetensors checkpoint (model/checkpoint.py).

Two properties: what a rank loads equals its slice of the TP 1 load for every parameter kind (split and
replicated KV heads, qkv bias, q/k norms, Gemma's folded norms, tied embeddings, a vocabulary TP does not
divide); and what it reads is only that: the bytes it takes out of the file, and the file pages it touches
(the checkpoint is memory-mapped, so a whole-tensor read would fault in every page of the tensor).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.config import ModelConfig
from pdserve.model.arch import ModelArch
from pdserve.model.checkpoint import SafetensorsWeights, load_checkpoint
from pdserve.model.loader import build_decoder, load_model
from pdserve.model.parallel import param_slices, shard_for, shard_param

PAGE = 4096


class _NoCollectives:
    """Collectives for a decoder that is only loaded, never run."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not expected")

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not expected")


def _write_checkpoint(folder: Path, config: dict[str, object], seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json and a model.safetensors of random float32 tensors with the Hugging Face names of a
    Llama/Qwen2 checkpoint (biases when qkv_bias); returns the tensors."""
    arch = ModelArch.from_hf_config(config)
    gen = torch.Generator().manual_seed(seed)
    hidden, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    sd = {"model.embed_tokens.weight": rand(arch.vocab_size, hidden), "model.norm.weight": rand(hidden)}
    if not arch.tie_word_embeddings:
        sd["lm_head.weight"] = rand(arch.vocab_size, hidden)
    for i in range(arch.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for x, heads in (("q", arch.num_heads), ("k", arch.num_kv_heads), ("v", arch.num_kv_heads)):
            sd[a + f"{x}_proj.weight"] = rand(heads * d, hidden)
            if arch.qkv_bias:
                sd[a + f"{x}_proj.bias"] = rand(heads * d)
        sd[a + "o_proj.weight"] = rand(hidden, arch.num_heads * d)
        sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"] = rand(inter, hidden), rand(inter, hidden)
        sd[m + "down_proj.weight"] = rand(hidden, inter)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = rand(hidden)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(sd, str(folder / "model.safetensors"))
    return sd


def _odd_vocab_config() -> dict[str, object]:
    """Qwen2 (qkv bias), 1 KV head (replicated at TP 2 and 4), vocab 101 (rows padded on the last rank)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "vocab_size": 101,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }


def _assert_ranks_equal_slices(folder: Path, tp: int) -> None:
    cfg = ModelConfig(model=str(folder))
    whole = dict(load_model(cfg).decoder.named_parameters())
    for rank in range(tp):
        part = load_model(cfg, tp, rank, comm=_NoCollectives()).decoder
        for name, param in part.named_parameters():
            expected = shard_param(name, whole[name], part.arch, part.shard)
            assert torch.equal(param, expected), (tp, rank, name)


@pytest.mark.parametrize(
    ("family", "tp"),
    [
        ("llama", 2),  # 2 KV heads split
        ("llama", 4),  # 2 KV heads, each replicated on 2 ranks
        ("mistral", 2),  # 1 KV head replicated
        ("llama_tied", 2),  # tied embeddings (no lm_head parameter)
        ("qwen2", 2),  # qkv bias
        ("qwen3", 2),  # q/k norms, head_dim != hidden / heads
        ("gemma3", 2),  # (1 + weight) norms folded at load, sandwich norms, tied
    ],
)
def test_rank_loads_its_slice_of_every_parameter(tiny_model_dirs: dict[str, Path], family: str, tp: int) -> None:
    _assert_ranks_equal_slices(tiny_model_dirs[family], tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_not_divisible_and_replicated_kv(tmp_path: Path, tp: int) -> None:
    """Against the checkpoint itself: vocabulary rows zero-padded past V, the replicated KV head's rows,
    o_proj's and down_proj's columns, q rows and their bias."""
    folder = tmp_path / "odd"
    sd = _write_checkpoint(folder, _odd_vocab_config())
    _assert_ranks_equal_slices(folder, tp)
    per_rank = -(-101 // tp)
    for rank in range(tp):
        dec = load_model(ModelConfig(model=str(folder)), tp, rank, comm=_NoCollectives()).decoder
        start, stop = rank * per_rank, min(101, (rank + 1) * per_rank)
        assert dec.lm_head is not None
        for weight, theirs in (
            (dec.embed_tokens.weight, "model.embed_tokens.weight"),
            (dec.lm_head.weight, "lm_head.weight"),
        ):
            assert weight.shape[0] == per_rank
            assert torch.equal(weight[: stop - start], sd[theirs][start:stop])
            assert not weight[stop - start :].any()  # padding rows are zeros
        layer, a = dec.decoder_layers[1], "model.layers.1.self_attn."
        q_rows = slice(rank * 8 * 4 // tp, (rank + 1) * 8 * 4 // tp)  # head_dim 8, 4 / tp heads per rank
        q, k, v = layer.qkv_proj.weight.split([8 * 4 // tp, 8, 8])
        assert torch.equal(q, sd[a + "q_proj.weight"][q_rows])
        assert torch.equal(k, sd[a + "k_proj.weight"]) and torch.equal(v, sd[a + "v_proj.weight"])  # the one head
        assert torch.equal(layer.qkv_proj.bias[: 8 * 4 // tp], sd[a + "q_proj.bias"][q_rows])
        assert torch.equal(layer.o_proj.weight, sd[a + "o_proj.weight"][:, q_rows])
        cols = slice(rank * 64 // tp, (rank + 1) * 64 // tp)
        assert torch.equal(layer.down_proj.weight, sd["model.layers.1.mlp.down_proj.weight"][:, cols])


def test_rank_reads_only_its_bytes(tmp_path: Path) -> None:
    """The bytes a rank takes out of the file are exactly those it keeps: 1/N of every split tensor plus the
    replicated norms and KV head (TP 1 reads the whole file's tensors)."""
    folder = tmp_path / "odd"
    sd = _write_checkpoint(folder, _odd_vocab_config())
    total = sum(t.numel() * 4 for t in sd.values())
    arch = ModelArch.from_hf_config(_odd_vocab_config())
    for tp in (1, 2, 4):
        for rank in range(tp):
            shard = shard_for(arch, tp, rank)
            decoder = build_decoder(arch, torch.device("cpu"), torch.float32, shard, _NoCollectives())
            weights = SafetensorsWeights(folder)
            load_checkpoint(decoder, weights)
            kept = sum(
                (p.shape[0] - param_slices(n, arch, shard).pad_rows) * p[0].numel() * 4
                for n, p in decoder.named_parameters()
            )
            assert weights.num_bytes_read == kept, (tp, rank)
            if tp == 1:
                assert kept == total
            else:
                assert kept < total / tp + total * 0.12, (tp, rank, kept, total)  # + norms, replicated KV


def _touched_file_pages(path: Path) -> set[int]:
    """Pages of `path` (file page numbers) present in this process's mappings of it (/proc/self/pagemap)."""
    pages: set[int] = set()
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or fields[5] != str(path):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            first_page = int(fields[2], 16) // PAGE
            pagemap.seek(lo // PAGE * 8)
            entries = pagemap.read((hi - lo) // PAGE * 8)
            for i in range((hi - lo) // PAGE):
                if struct.unpack_from("<Q", entries, 8 * i)[0] >> 63:
                    pages.add(first_page + i)
    return pages


def _tensor_byte_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """name -> [begin, end) byte offsets of its data in a safetensors file (from the file's header)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1]) for k, v in header.items() if k[0] != "_"}


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_rank_touches_only_its_pages_of_row_split_tensors(tmp_path: Path) -> None:
    """gate/up_proj of 16 MiB each, a rank of 4 keeps 4 MiB of each: the file pages it faulted in cover those
    4 MiB and not much more (the kernel maps up to a large folio, 2 MiB, past either end of a range), where
    reading the whole tensor (and then slicing) would touch all 16 MiB. Column-split down_proj is not
    checked: a column range touches part of every row, so whole pages of every row (model/checkpoint.py)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 32768,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 64,
    }
    folder = tmp_path / "wide"
    _write_checkpoint(folder, config)
    path = (folder / "model.safetensors").resolve()
    arch = ModelArch.from_hf_config(config)
    shard = shard_for(arch, 4, 2)
    decoder = build_decoder(arch, torch.device("cpu"), torch.float32, shard, _NoCollectives())
    assert not _touched_file_pages(path)
    weights = SafetensorsWeights(folder)
    load_checkpoint(decoder, weights)
    touched = _touched_file_pages(path)
    slack = 2 * (2 << 20) // PAGE + 32  # a 2 MiB folio past each end, fault-around
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        begin, end = _tensor_byte_ranges(path)[name]
        row_bytes = (end - begin) // 32768
        kept_begin, kept_end = begin + 2 * 8192 * row_bytes, begin + 3 * 8192 * row_bytes  # rank 2 of 4
        kept = set(range(kept_begin // PAGE, (kept_end - 1) // PAGE + 1))
        in_tensor = {p for p in touched if begin // PAGE <= p <= (end - 1) // PAGE}
        assert kept <= in_tensor, f"{name}: the kept range was not read through this mapping (measurement broken?)"
        assert len(in_tensor) <= len(kept) + slack, (name, len(in_tensor), len(kept), (end - begin) // PAGE)
    del weights
