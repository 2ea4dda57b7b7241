"""The decode step's linears on the CPU: weights packed once into column panels, a few rows at a time through
csrc/small_gemm.c (built into cpu_attention's library).

Why: at a handful of rows a linear is bound by reading its weight, and MKL's sgemm packs that weight again on
every call. Measured on the built-in model's 30 layers of weights (420 MB, streamed from memory as a decode step
does, 2 threads): 8 rows 37.7 ms through F.linear vs 28.4 ms from panels, 16 rows 45.3 vs 34.1; one row 16.9 vs
18.4 and 32 rows 48.4 vs 50.7, so F.linear keeps those (MAX_ROWS). The packed copy costs a second copy of every
linear weight, so models whose linear weights exceed PACK_MAX_BYTES are not packed (F.linear throughout).

PanelLinears holds the packed copies, keyed by the module (or "lm_head"); Decoder owns one, built after loading
(`pack_decoder`), and the CPU layer path (cpu_layer.forward_cpu) and Decoder.logits call `linear`.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 2  # fewer rows: F.linear (MKL's one-row GEMV already reads the weight once; measured as fast or faster)
MAX_ROWS = 16  # more rows: F.linear (MKL's GEMM amortizes its packing; measured faster from 32 rows)
PACK_MAX_BYTES = 4 * 2**30  # linear weights beyond this are not duplicated (memory over a few ms per step)


def pack(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width] contiguous: panel p holds columns p * width .. of W^T, zero-padded."""
    n, k = weight.shape
    panels = -(-n // width)
    wt = torch.zeros(k, panels * width, dtype=weight.dtype)
    wt[:, :n] = weight.t()
    return wt.view(k, panels, width).permute(1, 0, 2).contiguous()


class PanelLinears:
    """Packed weights of a decoder's CPU linears (float32) and the call that uses them."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.width = int(lib.pdserve_linear_panel_width())
        self.panels: dict[nn.Module | str, tuple[torch.Tensor, int]] = {}  # key -> (panels, N)
        self.nbytes = 0

    def add(self, key: nn.Module | str, weight: torch.Tensor) -> None:
        packed = pack(weight.detach(), self.width)
        self.panels[key] = (packed, weight.shape[0])
        self.nbytes += packed.numel() * packed.element_size()

    def linear(
        self, key: nn.Module | str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ weight^T + bias: from the panels when M is in [MIN_ROWS, MAX_ROWS] and key was packed,
        else F.linear (the same values up to rounding)."""
        entry = self.panels.get(key)
        m = x.shape[0]
        if entry is None or not MIN_ROWS <= m <= MAX_ROWS or x.dim() != 2:
            return F.linear(x, weight, bias)
        packed, n = entry
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        self.lib.pdserve_linear_panels_f32(x.data_ptr(), m, x.shape[1], x.stride(0), packed.data_ptr(), n, b,
                                           y.data_ptr(), n)  # fmt: skip
        return y


def linear_bytes(decoder: nn.Module) -> int:
    """Bytes of every nn.Linear weight in `decoder` (what packing duplicates, the LM head aside)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in decoder.modules() if isinstance(m, nn.Linear))
