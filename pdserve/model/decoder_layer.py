"""One decoder layer (attention + MLP) and its RMSNorm, with the portable torch forward and the fused CUDA one.

The CPU float32 path of the same layer is cpu/layer.forward_cpu; the decoder (decoder.py) stacks the layers,
embeds, and picks the path per step. Lives apart from decoder.py so that each file is one level of the model:
the layer's weights and math here, the stack, embedding, logits and path choice there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.arch import ModelArch
from pdserve.model.attention import paged_attention
from pdserve.model.paged import AttentionContext, write_kv
from pdserve.model.parallel import Collectives, TPShard
from pdserve.model.rotary import apply_rope


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in float32, times the weight (Gemma's (1 + weight) is folded at load)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel output's partial sums over ranks (identity at TP 1)."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
        ctx: AttentionContext,
        cpu_kernel: bool = True,  # CPU decode rows through cpu/attention.py's kernel when it is built
        cpu_prefill_kernel: bool = True,  # CPU prefill spans through its prefill kernel (with cpu_kernel)
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
        attn = paged_attention(q, layer_cache, ctx, self.scale, k, v, self.window, cpu_kernel, cpu_prefill_kernel)
        o = self.reduce(self.o_proj(attn.reshape(t, self.q_size)))
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + o
            gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
            return x + self.reduce(self.down_proj(F.silu(gate) * up))
        x = x + self.post_attention_layernorm(o)  # gemma: sandwich norms
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        mlp = self.reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))
        return x + self.post_feedforward_layernorm(mlp)

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (before its residual add)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream, None before the first layer
        positions: torch.Tensor,  # [T] int64
        cos_sin: torch.Tensor,  # [max_positions, 2, head_dim / 2] float32 (cuda/kernels.rope_cos_sin)
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
        ctx: AttentionContext,
        gemv: bool = False,  # one row: linear layers through the Triton GEMV instead of cuBLAS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path of forward(): returns (this layer's MLP output, residual stream); their sum is forward()'s."""
        from pdserve.model.cuda import kernels as ck

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
        x = self.reduce(linear(self.o_proj, attn.reshape(t, self.q_size)))
        post, pre_ff, post_ff = (
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        if pre_ff is None or post_ff is None:
            h, residual = ck.add_rmsnorm(x, residual, post.weight, post.eps)
            return self.reduce(linear(self.down_proj, ck.silu_and_mul(linear(self.gate_up_proj, h)))), residual
        # gemma's sandwich: norm the attention output, add, norm into the MLP; its output leaves normed
        h, residual = ck.add_rmsnorm(
            ck.add_rmsnorm(x, None, post.weight, post.eps)[0], residual, pre_ff.weight, pre_ff.eps
        )
        mlp = self.reduce(linear(self.down_proj, ck.act_and_mul(linear(self.gate_up_proj, h), self.gelu)))
        return ck.add_rmsnorm(mlp, None, post_ff.weight, post_ff.eps)[0], residual
