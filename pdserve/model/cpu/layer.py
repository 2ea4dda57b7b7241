"""The CPU float32 path of a decoder layer: forward()'s math with its small ops fused into single C/OpenMP passes
(layer_ops.py), decode rows reading the paged cache in place (attention.py) and linears from weights packed
once (linear.py).

It mirrors DecoderLayer.forward_fused with the C kernels in place of the Triton ones. It lives apart so that the
CUDA path stays as it was measured and the layer's module stays the model's definition; the decoder calls
forward_cpu for every layer when the library is built and the step is float32 on the CPU.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pdserve.model.attention import paged_attention
from pdserve.model.cpu import layer_ops as cpu_ops
from pdserve.model.cpu.linear import PackedLinears
from pdserve.model.decoder_layer import DecoderLayer
from pdserve.model.paged import AttentionContext


def _linear(panels: PackedLinears | None, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module(x) if panels is None else panels.linear(module, x, module.weight, module.bias)


def forward_cpu(
    layer: DecoderLayer,
    lib: ctypes.CDLL,  # the CPU kernel library (kernels.library())
    x: torch.Tensor,  # [T, hidden]: the previous layer's output (before its residual add)
    residual: torch.Tensor | None,  # [T, hidden]: the residual stream (updated in place), None at layer 0
    cos: torch.Tensor,  # [T, 1, head_dim / 2] float32
    sin: torch.Tensor,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], strided (layer_view)
    ctx: AttentionContext,
    panels: PackedLinears | None = None,  # packed linear weights (linear.py); None: F.linear
    prefill_kernel: bool = True,  # prefill spans through the C prefill kernel (False: torch's SDPA)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU float32 path of layer.forward(), its small ops fused (layer_ops.py): returns (this layer's MLP
    output, residual stream), whose sum is forward()'s."""
    t = x.shape[0]
    h, residual = cpu_ops.add_rmsnorm(lib, x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
    qkv = _linear(panels, layer.qkv_proj, h)  # [T, q_size + 2 * kv_size]; q and k are rotated in place below
    cpu_ops.qkv_rope_store(
        lib,
        qkv,
        cos,
        sin,
        None if layer.q_norm is None else layer.q_norm.weight,
        None if layer.k_norm is None else layer.k_norm.weight,
        layer.input_layernorm.eps if layer.q_norm is None else layer.q_norm.eps,
        layer_cache,
        ctx.slot_mapping,
        layer.num_heads,
        layer.num_kv_heads,
    )
    q = qkv[:, : layer.q_size].view(t, layer.num_heads, layer.head_dim)
    k = qkv[:, layer.q_size : layer.q_size + layer.kv_size].view(t, layer.num_kv_heads, layer.head_dim)
    v = qkv[:, layer.q_size + layer.kv_size :].view(t, layer.num_kv_heads, layer.head_dim)
    attn = paged_attention(  # [T, num_heads, head_dim]
        q, layer_cache, ctx, layer.scale, k, v, layer.window, cpu_prefill_kernel=prefill_kernel
    )
    x = layer.reduce(_linear(panels, layer.o_proj, attn.reshape(t, layer.q_size)))
    post, pre_ff, post_ff = (
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm,
    )
    if pre_ff is None or post_ff is None:
        h, residual = cpu_ops.add_rmsnorm(lib, x, residual, post.weight, post.eps)
        return layer.reduce(
            _linear(panels, layer.down_proj, cpu_ops.act_and_mul(lib, _linear(panels, layer.gate_up_proj, h)))
        ), residual
    # gemma's sandwich: norm the attention output, add, norm into the MLP; its output leaves normed
    normed = cpu_ops.add_rmsnorm(lib, x, None, post.weight, post.eps)[0]
    h, residual = cpu_ops.add_rmsnorm(lib, normed, residual, pre_ff.weight, pre_ff.eps)
    mlp = layer.reduce(
        _linear(panels, layer.down_proj, cpu_ops.act_and_mul(lib, _linear(panels, layer.gate_up_proj, h), layer.gelu))
    )
    return cpu_ops.add_rmsnorm(lib, mlp, None, post_ff.weight, post_ff.eps)[0], residual
