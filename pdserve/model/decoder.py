"""One generic decoder for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) and Gemma 3's text decoder.

Per-family deltas are flags on ModelArch: qkv_bias (Qwen2), qk_norm (Qwen3, Gemma 3), rope_scaling (Llama 3,
linear), tie_word_embeddings, layer_windows (sliding-window attention per layer: Mistral, Qwen2/3
use_sliding_window, Gemma 3's local layers), and Gemma 3's: (1 + weight) RMSNorm (folded into the weight at
load, so every norm below is a plain RMSNorm), sandwich norms around attention and MLP, GELU-tanh, embedding
scale, query_pre_attn_scalar, a local rotary base for windowed layers and final logit softcapping. Weights are
stored fused (qkv, gate_up) and loaded from Hugging Face names (model/checkpoint.py).

On CUDA (with Triton) forward() takes the fused path: add+RMSNorm, q/k-norm+rotary+KV store and SiLU- (or
GELU-tanh-) and-mul as single Triton kernels (cuda/kernels.py), flash prefill and a paged-decode kernel
(cuda/attention.py), windowed layers included (the kernels take the layer's window); the same weights and the
same function, about 10 launches per layer instead of ~60. Gemma 3's deltas there: its sandwich norms are
plain add+RMSNorm launches (the (1 + weight) is folded at load), GELU-tanh in the act-and-mul kernel, the
local layers' rotary table, the embedding scale (embed()) and softcapping (logits()), both shared with the
portable path. `Decoder.use_fused_kernels = False` forces the portable path (benchmarks compare the two);
its attention still takes cuda/attention.py on CUDA.

On the CPU (float32) forward() takes cpu/layer.forward_cpu for every layer when the C kernel library is built
(cpu/kernels.py, built on first use): add+RMSNorm, q/k-norm+rotary+KV store and SiLU- (or GELU-tanh-) and-mul
as one C/OpenMP pass each (cpu/layer_ops.py), and decode rows read the paged cache in place. Without the library:
the portable torch ops and gather-and-matmul attention. `Decoder.use_cpu_kernel = False` forces the portable
path there; `use_cpu_prefill_kernel = False` sends prefill spans to torch's SDPA instead of the C kernel.

The layer itself (its weights, portable and fused CUDA forward) is decoder_layer.py; rotary embedding is rotary.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kv.groups import KVGroups
from pdserve.model.arch import ModelArch
from pdserve.model.attention import cuda_kernels_usable
from pdserve.model.cpu import kernels as cpu_kernels
from pdserve.model.cpu import layer_ops as cpu_ops
from pdserve.model.cpu.layer import forward_cpu
from pdserve.model.cpu.linear import (
    PACK_MAX_BYTES,
    PackedLinears,
    gemm_library,
    library_parts,
    linear_bytes,
    mkl_packed_gemm,
)
from pdserve.model.decoder_layer import DecoderLayer, RMSNorm
from pdserve.model.paged import AttentionContext, layer_view
from pdserve.model.parallel import Collectives, TPShard, shard_for
from pdserve.model.rotary import cos_sin, rope_inv_freq


class Decoder(nn.Module):
    """forward(input_ids [T], positions [T], kv_cache, ctx) -> hidden [T, hidden]; logits(hidden) -> [N, vocab].

    With a tensor-parallel `shard` (model/parallel.py) every rank calls forward() and logits() on the same
    inputs, in the same order: each holds its slice of the weights and of the KV cache ([..., num_kv_heads of
    this rank, head_dim]) and the collectives in `comm` make hidden states and logits whole on every rank."""

    inv_freq: torch.Tensor  # [head_dim / 2] float32, a buffer (register_buffer in __init__)
    inv_freq_local: torch.Tensor  # [head_dim / 2] float32: gemma's windowed layers (= inv_freq otherwise)

    def __init__(self, arch: ModelArch, shard: TPShard | None = None, comm: Collectives | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.shard = shard or shard_for(arch)
        if self.shard.is_parallel and comm is None:
            raise ValueError(f"a decoder on {self.shard.size} tensor-parallel ranks needs their collectives")
        self.comm = comm if self.shard.is_parallel else None
        vocab = self.shard.vocab_per_rank  # the whole vocabulary at TP 1
        # its weight given (uninitialized; build_decoder constructs on the meta device and loads or draws every
        # weight after): nn.Embedding's own init, normal_ on the meta device, imports torch._dynamo (~2 s of CPU)
        self.embed_tokens = nn.Embedding(vocab, arch.hidden_size, _weight=torch.empty(vocab, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, self.shard, self.comm, i) for i in range(arch.num_layers))
        self.kv_groups = KVGroups.of(arch.layer_windows, arch.num_layers)  # kv/groups.py
        self._layer_slots = self.kv_groups.layer_slots()  # layer -> (group, slot in a block)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(arch, local=True), persistent=False)
        self.use_fused_kernels = True  # on CUDA: the Triton/flash path (see the module docstring)
        self.use_cpu_kernel = True  # on the CPU: decode attention through cpu/attention.py's C kernel
        self.use_cpu_prefill_kernel = True  # on the CPU: prefill spans through its C kernel (needs use_cpu_kernel
        # too; False: torch's SDPA, scripts/bench_cpu_prefill.py compares the two)
        self.use_cpu_layer_ops = True  # on the CPU: cpu/layer.forward_cpu's fused small ops (needs use_cpu_kernel
        # too; False keeps the attention kernel and takes the portable small ops: benchmarks compare the two)
        self.cpu_linears: PackedLinears | None = None  # on the CPU: packed linear weights (cpu/linear.py;
        # pack_cpu_linears builds it after loading; None = F.linear throughout)
        # fused path: cos/sin per position (global rotary, gemma's local rotary), built on first use
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.gemv_max_rows = 0  # fused path: steps of at most this many rows use the Triton GEMV (set by
        # cuda_graphs.DecodeGraphs.capture where it measured faster than cuBLAS; 0 = never)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (iterating the ModuleList yields plain Modules to a type checker)."""
        return cast(list[DecoderLayer], list(self.layers))

    def uses_fused_kernels(self, device: torch.device) -> bool:
        """Whether forward() on `device` takes the fused CUDA path: CUDA, Triton, a power-of-two head dim (every
        family's deltas are in it, Gemma 3's included; windowed layers too)."""
        return self.use_fused_kernels and cuda_kernels_usable(device, self.arch.head_dim)

    def reset_rope(self, device: torch.device) -> None:
        """Recompute the rotary buffers on `device` in float32 (after building on the meta device)."""
        self.inv_freq = rope_inv_freq(self.arch).to(device)
        self.inv_freq_local = rope_inv_freq(self.arch, local=True).to(device)
        self._rope_tables = None

    def _layer_caches(
        self, kv_cache: torch.Tensor, ctx: AttentionContext | Sequence[AttentionContext]
    ) -> list[tuple[torch.Tensor, AttentionContext]]:
        """(cache view, context) of every layer. One context: every layer reads the same block tables from a
        cache of num_layers per block. One context per KV group (kv/groups.py): layer i reads its
        group's tables and its slot of a cache of layers_per_block per block."""
        if isinstance(ctx, AttentionContext):
            return [(layer_view(kv_cache, i), ctx) for i in range(self.arch.num_layers)]
        return [(layer_view(kv_cache, slot), ctx[g]) for g, slot in self._layer_slots]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers (or layers_per_block), 2, block_size, kv heads, head_dim]
        ctx: AttentionContext | Sequence[AttentionContext],  # one, or one per KV group
    ) -> torch.Tensor:
        if self.uses_fused_kernels(input_ids.device):
            return self._forward_fused(input_ids, positions, kv_cache, ctx)
        x = self.embed(input_ids)
        cos, sin = cos_sin(positions, self.inv_freq, x.dtype)
        local = cos_sin(positions, self.inv_freq_local, x.dtype) if self.arch.local_rope_theta else None
        caches = self._layer_caches(kv_cache, ctx)
        lib = self._cpu_library(x, caches[0][0]) if caches else None
        prefill_kernel = self.use_cpu_prefill_kernel
        if lib is not None:  # CPU float32: the layers' small ops fused (cpu/layer_ops.py)
            residual: torch.Tensor | None = None
            for layer, (cache, layer_ctx) in zip(self.decoder_layers, caches, strict=True):
                c, s = local if layer.local_rope and local is not None else (cos, sin)
                x, residual = forward_cpu(
                    layer, lib, x, residual, c, s, cache, layer_ctx, self.cpu_linears, prefill_kernel
                )
            return cpu_ops.add_rmsnorm(lib, x, residual, self.norm.weight, self.norm.eps)[0]
        for layer, (cache, layer_ctx) in zip(self.decoder_layers, caches, strict=True):
            c, s = local if layer.local_rope and local is not None else (cos, sin)
            x = layer(x, c, s, cache, layer_ctx, self.use_cpu_kernel, prefill_kernel)
        return self.norm(x)

    def _cpu_library(self, x: torch.Tensor, layer_cache: torch.Tensor) -> ctypes.CDLL | None:
        """The CPU kernel library when this step takes the fused CPU path (use_cpu_kernel and use_cpu_layer_ops,
        float32 on the CPU, the library built), else None: the portable layers below."""
        wanted = self.use_cpu_kernel and self.use_cpu_layer_ops
        if not wanted or not cpu_ops.fits(x, layer_cache, self.arch.head_dim):
            return None
        return cpu_kernels.library()

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        ctx: AttentionContext | Sequence[AttentionContext],
    ) -> torch.Tensor:
        from pdserve.model.cuda.kernels import add_rmsnorm, rope_cos_sin

        if self._rope_tables is None or self._rope_tables[0].device != input_ids.device:
            n = self.arch.max_position_embeddings
            glob = rope_cos_sin(self.inv_freq.to(input_ids.device), n)
            local = rope_cos_sin(self.inv_freq_local.to(input_ids.device), n) if self.arch.local_rope_theta else glob
            self._rope_tables = (glob, local)
        glob, local = self._rope_tables
        x, residual = self.embed(input_ids), None
        gemv = input_ids.shape[0] <= min(self.gemv_max_rows, 1)  # the GEMV kernel takes one row
        for layer, (cache, layer_ctx) in zip(self.decoder_layers, self._layer_caches(kv_cache, ctx), strict=True):
            table = local if layer.local_rope else glob
            x, residual = layer.forward_fused(x, residual, positions, table, cache, layer_ctx, gemv)
        return add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]; with TP each rank looks up the ids in its vocabulary slice and the sum is whole.
        Gemma scales by sqrt(hidden), rounded to the weights' dtype first (as transformers does)."""
        if self.comm is None:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.shard.vocab_start
            mine = (local >= 0) & (local < self.shard.vocab_per_rank)  # [T]
            x = self.embed_tokens(local.clamp(0, self.shard.vocab_per_rank - 1))
            x = self.comm.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))
        if self.arch.embed_scale is None:
            return x
        return x * torch.tensor(self.arch.embed_scale, dtype=torch.float32).to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (with TP: gathered from every rank's vocabulary slice)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.cpu_linears is not None and hidden.device.type == "cpu" and hidden.dtype == torch.float32:
            logits = self.cpu_linears.linear("lm_head", hidden, weight)
        else:
            logits = F.linear(hidden, weight).float()
        if self.comm is not None:
            logits = self.comm.all_gather_last(logits)[:, : self.shard.vocab_size]
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


@torch.no_grad()
def use_column_major_linears(decoder: Decoder) -> None:
    """Store every layer's linear weight [out, in] transposed in memory (strides (1, out)); shapes, values and
    names stay as they were. On the CPU F.linear then hands the GEMM an untransposed right operand, which MKL
    runs 2.3x faster at 8 rows (gate_up, a batch-8 decode step) and as fast at 1 and 512 rows, bit for bit the
    same output at 512 rows (scripts/profile_cpu_engine.py's bare-op section measures it). The embedding (also
    the tied LM head) keeps its rows contiguous for the lookup."""
    for layer in decoder.decoder_layers:
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            linear.weight = nn.Parameter(linear.weight.t().contiguous().t(), requires_grad=False)


@torch.no_grad()
def pack_cpu_linears(decoder: Decoder) -> None:
    """Give a float32 CPU decoder packed copies of its layers' linear weights and of its LM head (cpu/linear.py
    says why and what it measured, and which library packs on which CPU); nothing when no library can pack, or
    the weights are too large to duplicate (cpu/linear.PACK_MAX_BYTES)."""
    head = decoder.embed_tokens.weight if decoder.lm_head is None else decoder.lm_head.weight
    if head.dtype != torch.float32 or head.device.type != "cpu":
        return
    library, lib = gemm_library(), cpu_kernels.library()
    if lib is None:  # no compiler: the packed GEMM alone, if any
        library = library_parts(library)[1]
    copies = sum(map(bool, library_parts(library)))  # the panels' and the packed GEMM's
    if not copies or copies * (linear_bytes(decoder) + head.numel() * head.element_size()) > PACK_MAX_BYTES:
        return
    packed = PackedLinears(library, lib, mkl_packed_gemm())
    for layer in decoder.decoder_layers:
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            packed.add(linear, linear.weight)
    packed.add("lm_head", head)
    decoder.cpu_linears = packed
