"""One generic decoder for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) and Gemma 3's text decoder.

Per-family deltas are flags on ModelArch: qkv_bias (Qwen2), qk_norm (Qwen3, Gemma 3), rope_scaling (Llama 3,
linear), tie_word_embeddings, layer_windows (sliding-window attention per layer: Mistral, Qwen2/3
use_sliding_window, Gemma 3's local layers), and Gemma 3's: (1 + weight) RMSNorm (folded into the weight at
load, so every norm below is a plain RMSNorm), sandwich norms around attention and MLP, GELU-tanh, embedding
scale, query_pre_attn_scalar, a local rotary base for windowed layers and final logit softcapping. Weights are
stored fused (qkv, gate_up) and loaded from Hugging Face names (model/checkpoint.py).

On CUDA (with Triton) forward() takes the fused path: add+RMSNorm, q/k-norm+rotary+KV store and SiLU- (or
GELU-tanh-) and-mul as single Triton kernels (cuda_kernels.py), flash prefill and a paged-decode kernel
(cuda_attention.py), windowed layers included (the kernels take the layer's window); the same weights and the
same function, about 10 launches per layer instead of ~60. Gemma 3's deltas there: its sandwich norms are
plain add+RMSNorm launches (the (1 + weight) is folded at load), GELU-tanh in the act-and-mul kernel, the
local layers' rotary table, the embedding scale (embed()) and softcapping (logits()), both shared with the
portable path. `Decoder.use_fused_kernels = False` forces the portable path (benchmarks compare the two);
its attention still takes cuda_attention on CUDA.

On the CPU (float32) forward() takes forward_cpu when the C kernel library is built (cpu_attention.py, built on
first use): add+RMSNorm, q/k-norm+rotary+KV store and SiLU- (or GELU-tanh-) and-mul as one C/OpenMP pass each
(cpu_layer_ops.py), and decode rows read the paged cache in place. Without the library: the portable torch ops
and gather-and-matmul attention. `Decoder.use_cpu_kernel = False` forces the portable path there.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import cpu_attention
from pdserve.model import cpu_layer_ops as cpu_ops
from pdserve.model.arch import ModelArch
from pdserve.model.attention import cuda_kernels_usable, paged_attention
from pdserve.model.kv_groups import KVGroups
from pdserve.model.paged import AttentionContext, layer_view, write_kv
from pdserve.model.parallel import Collectives, TPShard, shard_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(arch: ModelArch, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with llama3-style or linear scaling when the config asks for it.

    local: Gemma 3's windowed layers (their own base, no scaling)."""
    theta = arch.local_rope_theta if local and arch.local_rope_theta is not None else arch.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim))
    if arch.rope_scaling is None or local:
        return inv.float()
    s = dict(arch.rope_scaling)
    if s.get("rope_type", s.get("type")) == "linear":
        return (inv.float() / s["factor"]).float()
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim/2]. Rotate-half convention (Hugging Face layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """One layer; with a tensor-parallel shard it holds this rank's heads and MLP rows (model/parallel.py) and
    all-reduces the outputs of o_proj and down_proj (row-parallel) through `comm`."""

    def __init__(self, arch: ModelArch, shard: TPShard, comm: Collectives | None, index: int) -> None:
        super().__init__()
        h, d = shard.num_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, shard.num_kv_heads, d
        self.q_size, self.kv_size = h * d, shard.num_kv_heads * d
        self.scale = arch.attn_scale
        self.window = arch.window_of(index)  # keys a query sees, itself included; None = the whole context
        self.local_rope = arch.local_rope_theta is not None and self.window is not None  # gemma: local base
        self.gelu = arch.hidden_act == "gelu_tanh"
        self.comm = comm  # None at TP 1
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # gemma: post_attention_layernorm normalizes the attention output; these two wrap the MLP
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if arch.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if arch.sandwich_norms else None
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, arch.hidden_size, bias=False)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel output's partial sums over ranks (identity at TP 1)."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
        ctx: AttentionContext,
        cpu_kernel: bool = True,  # CPU decode rows through cpu_attention's kernel when it is built
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # one rotation over q and k heads together: half the small ops on the CPU
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        write_kv(layer_cache, k, v, ctx.slot_mapping)
        attn = paged_attention(q, layer_cache, ctx, self.scale, k, v, self.window, cpu_kernel)
        o = self._reduce(self.o_proj(attn.reshape(t, self.q_size)))
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + o
            gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
            return x + self._reduce(self.down_proj(F.silu(gate) * up))
        x = x + self.post_attention_layernorm(o)  # gemma: sandwich norms
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        mlp = self._reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))
        return x + self.post_feedforward_layernorm(mlp)

    def forward_cpu(
        self,
        lib: ctypes.CDLL,  # the CPU kernel library (cpu_attention.decode_kernel())
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (before its residual add)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream (updated in place), None at layer 0
        cos: torch.Tensor,  # [T, 1, head_dim / 2] float32
        sin: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU float32 path of forward(), its small ops fused (cpu_layer_ops.py): returns (this layer's MLP
        output, residual stream), whose sum is forward()'s. forward_fused's structure with the C kernels in place
        of the Triton ones; kept apart so that the CUDA path stays as it was measured."""
        t = x.shape[0]
        h, residual = cpu_ops.add_rmsnorm(lib, x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = self.qkv_proj(h)  # [T, q_size + 2 * kv_size]; q and k are rotated in place below
        cpu_ops.qkv_rope_store(
            lib,
            qkv,
            cos,
            sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.input_layernorm.eps if self.q_norm is None else self.q_norm.eps,
            layer_cache,
            ctx.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, layer_cache, ctx, self.scale, k, v, self.window)  # [T, num_heads, head_dim]
        x = self._reduce(self.o_proj(attn.reshape(t, self.q_size)))
        post, pre_ff, post_ff = (
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        if pre_ff is None or post_ff is None:
            h, residual = cpu_ops.add_rmsnorm(lib, x, residual, post.weight, post.eps)
            return self._reduce(self.down_proj(cpu_ops.act_and_mul(lib, self.gate_up_proj(h)))), residual
        # gemma's sandwich: norm the attention output, add, norm into the MLP; its output leaves normed
        normed = cpu_ops.add_rmsnorm(lib, x, None, post.weight, post.eps)[0]
        h, residual = cpu_ops.add_rmsnorm(lib, normed, residual, pre_ff.weight, pre_ff.eps)
        mlp = self._reduce(self.down_proj(cpu_ops.act_and_mul(lib, self.gate_up_proj(h), self.gelu)))
        return cpu_ops.add_rmsnorm(lib, mlp, None, post_ff.weight, post_ff.eps)[0], residual

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (before its residual add)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream, None before the first layer
        positions: torch.Tensor,  # [T] int64
        cos_sin: torch.Tensor,  # [max_positions, 2, head_dim / 2] float32 (cuda_kernels.rope_cos_sin)
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
        ctx: AttentionContext,
        gemv: bool = False,  # one row: linear layers through the Triton GEMV instead of cuBLAS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path of forward(): returns (this layer's MLP output, residual stream); their sum is forward()'s."""
        from pdserve.model import cuda_kernels as ck

        def linear(layer: nn.Linear, inp: torch.Tensor) -> torch.Tensor:
            return ck.gemv(inp, layer.weight, layer.bias) if gemv else layer(inp)

        t = x.shape[0]
        h, residual = ck.add_rmsnorm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = linear(self.qkv_proj, h)  # [T, q_size + 2 * kv_size]; q and k are rotated in place below
        ck.qkv_rope_store(
            qkv,
            positions,
            cos_sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            layer_cache,
            ctx.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.input_layernorm.eps if self.q_norm is None else self.q_norm.eps,
        )
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, layer_cache, ctx, self.scale, k, v, self.window)  # [T, num_heads, head_dim]
        x = self._reduce(linear(self.o_proj, attn.reshape(t, self.q_size)))
        post, pre_ff, post_ff = (
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        if pre_ff is None or post_ff is None:
            h, residual = ck.add_rmsnorm(x, residual, post.weight, post.eps)
            return self._reduce(linear(self.down_proj, ck.silu_and_mul(linear(self.gate_up_proj, h)))), residual
        # gemma's sandwich: norm the attention output, add, norm into the MLP; its output leaves normed
        h, residual = ck.add_rmsnorm(
            ck.add_rmsnorm(x, None, post.weight, post.eps)[0], residual, pre_ff.weight, pre_ff.eps
        )
        mlp = self._reduce(linear(self.down_proj, ck.act_and_mul(linear(self.gate_up_proj, h), self.gelu)))
        return ck.add_rmsnorm(mlp, None, post_ff.weight, post_ff.eps)[0], residual


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
        self.embed_tokens = nn.Embedding(vocab, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, self.shard, self.comm, i) for i in range(arch.num_layers))
        self.kv_groups = KVGroups.of(arch.layer_windows, arch.num_layers)  # model/kv_groups.py
        self._layer_slots = self.kv_groups.layer_slots()  # layer -> (group, slot in a block)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(arch, local=True), persistent=False)
        self.use_fused_kernels = True  # on CUDA: the Triton/flash path (see the module docstring)
        self.use_cpu_kernel = True  # on the CPU: decode attention through cpu_attention's C kernel
        self.use_cpu_layer_ops = True  # on the CPU: forward_cpu's fused small ops (needs use_cpu_kernel too;
        # False keeps the attention kernel and takes the portable small ops: benchmarks compare the two)
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
        cache of num_layers per block. One context per KV group (model/kv_groups.py): layer i reads its
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
        cos, sin = self._cos_sin(positions, self.inv_freq, x.dtype)
        local = self._cos_sin(positions, self.inv_freq_local, x.dtype) if self.arch.local_rope_theta else None
        caches = self._layer_caches(kv_cache, ctx)
        lib = self._cpu_library(x, caches[0][0]) if caches else None
        if lib is not None:  # CPU float32: the layers' small ops fused (cpu_layer_ops.py)
            residual: torch.Tensor | None = None
            for layer, (cache, layer_ctx) in zip(self.decoder_layers, caches, strict=True):
                c, s = local if layer.local_rope and local is not None else (cos, sin)
                x, residual = layer.forward_cpu(lib, x, residual, c, s, cache, layer_ctx)
            return cpu_ops.add_rmsnorm(lib, x, residual, self.norm.weight, self.norm.eps)[0]
        for layer, (cache, layer_ctx) in zip(self.decoder_layers, caches, strict=True):
            c, s = local if layer.local_rope and local is not None else (cos, sin)
            x = layer(x, c, s, cache, layer_ctx, self.use_cpu_kernel)
        return self.norm(x)

    def _cpu_library(self, x: torch.Tensor, layer_cache: torch.Tensor) -> ctypes.CDLL | None:
        """The CPU kernel library when this step takes the fused CPU path (use_cpu_kernel and use_cpu_layer_ops,
        float32 on the CPU, the library built), else None: the portable layers below."""
        wanted = self.use_cpu_kernel and self.use_cpu_layer_ops
        if not wanted or not cpu_ops.fits(x, layer_cache, self.arch.head_dim):
            return None
        return cpu_attention.decode_kernel()

    @staticmethod
    def _cos_sin(
        positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2] in `dtype`, computed in float32."""
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, head_dim/2], float32
        return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        ctx: AttentionContext | Sequence[AttentionContext],
    ) -> torch.Tensor:
        from pdserve.model.cuda_kernels import add_rmsnorm, rope_cos_sin

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
