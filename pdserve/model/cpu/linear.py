"""The CPU float32 linears from weights packed once at load time: MKL's packed GEMM (Intel CPUs), oneDNN's
prepacked linear with column panels through csrc/small_gemm.c for decode-sized steps (other CPUs), or the panels
alone (torch builds with neither).

Why: F.linear calls MKL's sgemm, which packs its weight operand again on every call. At a few rows (decode) that
doubles the weight traffic the step is bound by; at prefill sizes it is a repack of every weight from memory per
layer. MKL exports the packing as its own API (cblas_sgemm_pack / cblas_sgemm_compute; libtorch_cpu links MKL
statically and exports them), so a weight can be packed once and used for any row count. Measured over 30 layers
of the built-in model's linear shapes streamed from memory (column-major weights as the engine stores them, 2
threads, interleaved; `scripts/bench_cpu_linear.py`, docs/results/cpu/cpu_linear_mkl.json), F.linear vs packed:
2 rows 22.1 vs 17.8 ms, 8 rows 34.4 vs 24.1, 64 rows 54.5 vs 47.5, 512 rows 290.6 vs 270.3, 2048 rows 1120 vs
1134 (a tie); at one row a tie for the layers, the LM head faster (MIN_ROWS). The packed result
equals F.linear's bit for bit from 17 rows up (measured on row-major weights; MKL picks the same kernel) and
differs in the last bits below (as MKL's own 1-row and 8-row results do), never in the tokens
(tests/model/test_cpu_linear.py). The column panels of small_gemm.c were the first answer to the same problem
(same run: 8 rows 24.5 ms, 16 rows 29.7, no faster than F.linear from 32 rows), kept for torch builds without MKL.

The packed copy costs one more copy of every linear weight resident (MKL's buffer size is larger, but the pages
it never writes are never touched: RSS grew 7.1 MB per 7.1 MB weight); models whose linear weights exceed
PACK_MAX_BYTES are not packed (F.linear throughout).

Which library packs depends on the CPU: MKL's GEMM kernels are tuned per Intel core, and on other CPUs oneDNN's
(torch's `mkldnn._reorder_linear_weight` / `_linear_pointwise`, the prepacked linear vLLM's CPU backend uses too)
did more with the same weights. Same 30 layers, ms, MKL packed vs oneDNN packed: on an AMD EPYC (Zen 1, AVX2),
one thread, CPU time (the host was shared): 8 rows 4.8 vs 3.6 per layer, 64 rows 16.1 vs 14.0, 512 rows 110 vs
98 (the core's FMA peak); on an Intel Xeon with AVX-512 (the GPU machine's host, two cores pinned, wall time):
8 rows 34.5 vs 37.1, 64 rows 75.3 vs 92.8, 512 rows 514 vs 607, 2,048 rows 2,518 vs 2,970. So MKL on Intel CPUs,
oneDNN elsewhere.

And on that AMD host neither library (nor F.linear) serves decode-sized steps well, where the column panels
stream the weight at the memory's pace: 30 layers, 2 threads, quiet host, F.linear / MKL packed / oneDNN /
panels, ms: 1 row 34.0 / 40.9 / 34.4 / 23.0; 2 rows 55.1 / 64.5 / 35.6 / 25.3; 8 rows 96.8 / 102.4 / 59.9 / 41.2;
16 rows 124.1 / 129.7 / 83.6 / 64.4 (MKL's one-row GEMV does not even use the second thread there: 36.8 ms with
one). On the Intel host the panels only tie (1 row 22.0 vs F.linear 21.4, MKL packed 8 rows 30.6 vs 38.2). So
non-Intel CPUs take "panels+onednn": the panels up to PANEL_MAX_ROWS rows, oneDNN from there on (both copies
resident). `gemm_library` decides; PDSERVE_CPU_GEMM (one of GEMM_LIBRARIES) overrides it for A/B runs.

PackedLinears holds the packed copies, keyed by the module (or "lm_head"); Decoder owns one, built after loading
(`pack_cpu_linears`), and the CPU layer path (layer.forward_cpu) and Decoder.logits call `linear`.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 1  # the packed GEMMs serve every row count: at one row the layers tie with F.linear's GEMV (Intel Xeon,
# 30 layers, 2 threads: MKL packed 19.1-21.7 ms vs F.linear 19.7-21.4) and the LM head gains (4.9 vs 6.0 ms)
PANEL_MAX_ROWS = 16  # the column panels' range ends here (F.linear or the packed GEMM measured faster from 24 rows)
PACK_MAX_BYTES = 4 * 2**30  # linear weights beyond this are not duplicated (memory over a few ms per step)
# The row count MKL packs for: its packed layout depends on it (the size does not). Measured over the 30 layers
# (`scripts/bench_cpu_linear.py --hints 1,16,512 --rows 8,64,512,2048`), ms at 8 / 64 / 512 / 2048 rows: packed for
# 512 rows 23.1 / 49.5 / 289.4 / 1156; for 16 rows 24.0 / 64.4 / 357.3 / 1395; for 1 row 39.5 / 59.6 / 315.8 /
# 1169. One copy packed for 512 serves every row count.
PACK_ROWS_HINT = 512

# What serves the packed linears: one library, or the column panels up to PANEL_MAX_ROWS rows and a packed GEMM
# from there on ("panels+onednn", "panels+mkl").
GEMM_LIBRARIES = ("onednn", "mkl", "panels", "panels+onednn", "panels+mkl")

# CBLAS constants (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151


@cache
def mkl_packed_gemm() -> ctypes.CDLL | None:
    """torch's own library with MKL's packed-GEMM entry points typed, or None when this torch build lacks them."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        size, pack_, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    size.argtypes, size.restype = [i, i, i, i], ctypes.c_size_t
    pack_.argtypes, pack_.restype = [i, i, i, i, i, i, f, p, i, p], None
    compute.argtypes, compute.restype = [i, i, i, i, i, i, p, i, p, i, f, p, i], None
    return lib


def onednn_available() -> bool:
    """Whether this torch build carries oneDNN's prepacked linear."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...), "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def gemm_library() -> str:
    """The library the packed linears use here (one of GEMM_LIBRARIES): PDSERVE_CPU_GEMM if set, else MKL on Intel
    CPUs and the column panels with oneDNN above them on others (module doc), a packed GEMM this torch build lacks
    replaced by the other one (or dropped). Whether the panels' kernel library builds is the caller's check."""
    choice = os.environ.get("PDSERVE_CPU_GEMM", "")
    if choice and choice not in GEMM_LIBRARIES:
        raise ValueError(f"PDSERVE_CPU_GEMM={choice!r}: expected one of {', '.join(GEMM_LIBRARIES)}")
    if not choice:
        choice = "mkl" if cpu_vendor() == "GenuineIntel" else "panels+onednn"
    panels, gemm = library_parts(choice)
    if gemm == "onednn" and not onednn_available():
        gemm = "mkl"
    if gemm == "mkl" and mkl_packed_gemm() is None:
        gemm = "onednn" if onednn_available() else ""
    if not gemm:
        return "panels"
    return f"panels+{gemm}" if panels else gemm


def library_parts(library: str) -> tuple[bool, str]:
    """A GEMM_LIBRARIES name (or "") as (whether the column panels serve small steps, the packed GEMM: "mkl",
    "onednn" or "")."""
    if library == "panels":
        return True, ""
    panels, _, gemm = library.rpartition("+")
    return panels == "panels", gemm


def pack(weight: torch.Tensor, width: int) -> torch.Tensor:
    """Column panels: [N, K] -> [ceil(N / width), K, width] contiguous: panel p holds columns p * width .. of W^T,
    zero-padded."""
    n, k = weight.shape
    panels = -(-n // width)
    wt = torch.zeros(k, panels * width, dtype=weight.dtype)
    wt[:, :n] = weight.t()
    return wt.view(k, panels, width).permute(1, 0, 2).contiguous()


def mkl_pack(mkl: ctypes.CDLL, weight: torch.Tensor, rows_hint: int = PACK_ROWS_HINT) -> torch.Tensor:
    """MKL's packed form of W^T for y = x W^T, from a row-major [N, K] weight or its column-major twin (the engine
    stores linears column-major, use_column_major_linears), packed for `rows_hint` rows; a byte buffer only
    cblas_sgemm_compute reads."""
    n, k = weight.shape
    if weight.stride() == (k, 1):
        trans, ld = _TRANS, k  # B = W^T read from W's rows
    else:
        weight = weight.t().contiguous().t() if weight.stride() != (1, n) else weight
        trans, ld = _NO_TRANS, n  # W^T is a row-major [K, N] already
    m = rows_hint
    buf = torch.empty(mkl.cblas_sgemm_pack_get_size(_B_MATRIX, m, n, k), dtype=torch.uint8)
    mkl.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, trans, m, n, k, 1.0, weight.data_ptr(), ld, buf.data_ptr())
    return buf


class PackedLinears:
    """Packed weights of a decoder's CPU linears (float32) and the call that uses them. `library` is one of
    GEMM_LIBRARIES: the column panels (they need `lib`, the kernel library kernels.library()) serve
    1 to PANEL_MAX_ROWS rows, MKL's packed GEMM (`mkl`, mkl_packed_gemm()) or oneDNN's prepacked linear MIN_ROWS
    rows and up; a row count neither serves runs F.linear. MKL packs for `rows_hint` rows (PACK_ROWS_HINT says
    why 512; scripts/bench_cpu_linear.py --hints compares others)."""

    def __init__(
        self,
        library: str,
        lib: ctypes.CDLL | None = None,
        mkl: ctypes.CDLL | None = None,
        rows_hint: int = PACK_ROWS_HINT,
    ) -> None:
        if library not in GEMM_LIBRARIES:
            raise ValueError(f"unknown library {library!r}: expected one of {', '.join(GEMM_LIBRARIES)}")
        self.library = library
        self.panels, self.gemm = library_parts(library)
        if self.panels and lib is None:
            raise ValueError("the column panels need the kernel library")
        if self.gemm == "mkl" and mkl is None:
            raise ValueError("MKL's packed GEMM is not available")
        self.lib, self.mkl = lib, mkl
        self.rows_hint = rows_hint
        self.width = 0 if lib is None else int(lib.pdserve_linear_panel_width())
        # key -> (panels or None, the packed GEMM's copy or None, N, K)
        self.packed: dict[nn.Module | str, tuple[torch.Tensor | None, torch.Tensor | None, int, int]] = {}
        self.nbytes = 0  # resident bytes of the packed copies (a weight's own size for MKL: see the module doc)

    @property
    def backend(self) -> str:
        return self.library

    def add(self, key: nn.Module | str, weight: torch.Tensor) -> None:
        weight = weight.detach()
        n, k = weight.shape
        panels = gemm = None
        if self.panels:
            panels = pack(weight, self.width)
            self.nbytes += panels.numel() * panels.element_size()
        if self.gemm == "onednn":
            gemm = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        elif self.gemm == "mkl":
            assert self.mkl is not None
            gemm = mkl_pack(self.mkl, weight, self.rows_hint)
        if gemm is not None:
            self.nbytes += n * k * weight.element_size()
        self.packed[key] = (panels, gemm, n, k)

    def route(self, rows: int) -> str:
        """What serves a step of `rows` rows: "panels", "mkl", "onednn" or "" (F.linear)."""
        if self.panels and rows <= PANEL_MAX_ROWS:
            return "panels"
        return self.gemm if self.gemm and rows >= MIN_ROWS else ""

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs from the packed copies (else F.linear)."""
        return self.route(rows) != ""

    def linear(
        self, key: nn.Module | str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ weight^T + bias: from a packed copy when `route(M)` names one and key was packed, else F.linear
        (the same values up to rounding)."""
        entry = self.packed.get(key)
        m = x.shape[0]
        route = self.route(m) if entry is not None and x.dim() == 2 else ""
        if not route or entry is None:
            return F.linear(x, weight, bias)
        panels, gemm, n, k = entry
        if route == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), gemm, bias, "none", [], "")
        if x.stride(1) != 1:
            x = x.contiguous()
        if route == "mkl":
            assert self.mkl is not None and gemm is not None
            if bias is None:
                y, beta = torch.empty(m, n, dtype=x.dtype), 0.0
            else:
                y, beta = bias.repeat(m, 1), 1.0  # a copy always (expand(1, n).contiguous() is the bias itself)
            self.mkl.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), x.stride(0),
                                         gemm.data_ptr(), n, beta, y.data_ptr(), n)  # fmt: skip
            return y
        assert self.lib is not None and panels is not None
        y = torch.empty(m, n, dtype=x.dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        self.lib.pdserve_linear_panels_f32(x.data_ptr(), m, k, x.stride(0), panels.data_ptr(), n, b,
                                           y.data_ptr(), n)  # fmt: skip
        return y


def linear_bytes(decoder: nn.Module) -> int:
    """Bytes of every nn.Linear weight in `decoder` (what packing duplicates, the LM head aside)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in decoder.modules() if isinstance(m, nn.Linear))
