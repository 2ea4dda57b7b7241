"""Rotary position embedding: the inverse frequencies (with Llama 3 / linear scaling and Gemma 3's local base),
the rotate-half rotation and the per-step cos/sin.

Lives apart from the decoder because three paths use it (the portable layer, the fused CUDA tables built from
inv_freq, the CPU kernels fed with cos/sin) and tests compare kernels against apply_rope directly.
"""

from __future__ import annotations

import math

import torch

from pdserve.model.arch import ModelArch


def rope_inv_freq(arch: ModelArch, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with llama3-style or linear scaling when the config asks for it.

    local: Gemma 3's windowed layers (their own base, no scaling). Always on the CPU (the caller moves it), even
    under a `torch.device("meta")` block: arange on the meta device imports torch._dynamo (~2 s of CPU)."""
    theta = arch.local_rope_theta if local and arch.local_rope_theta is not None else arch.rope_theta
    positions = torch.arange(0, arch.head_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (positions / arch.head_dim))
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


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim / 2] in `dtype`, computed in float32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, head_dim/2], float32
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)
