"""Paged attention on the CPU that reads the block-major KV cache in place: decode rows (csrc/paged_decode.c)
and prefill spans, whole prompts or after cached context (csrc/paged_prefill.c).

attention.py serves decode rows with the decode kernel and prefill spans with the prefill kernel (when head_dim
is a multiple of PANEL; else torch's fused SDPA). The prefill kernel computes the causal triangle only, with
register-blocked products (csrc/panel_fma.h), faster than SDPA (scripts/bench_cpu_prefill.py; figures per
machine in docs/benchmarks.md).

The kernel is plain C with OpenMP, built with the system C compiler on first use (or ahead of time by `make
install`: `python -m pdserve.model.cpu_attention`) into ~/.cache/pdserve/kernels/ (XDG_CACHE_HOME respected),
one file per sources, flags and CPU, and loaded through ctypes: no torch headers, no ninja. It links the
libgomp torch already loaded, so it shares torch's OpenMP threads (torch.get_num_threads()).
The same library holds a decoder layer's fused small ops (csrc/layer_ops.c, called through cpu_layer_ops.py)
and the decode step's small-batch linears (csrc/small_gemm.c, called through cpu_linear.py).

When there is no compiler, the build fails or the inputs do not fit (not float32, not on the CPU),
`decode_kernel()` returns None and attention.py takes the portable gather-and-matmul path; both give the same
tokens (tests/model/test_cpu_attention.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from pdserve.model.paged import DecodeBatch

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("paged_decode.c", "paged_prefill.c", "layer_ops.c", "small_gemm.c"))
# included by the sources: part of the library's key
HEADERS = tuple(_CSRC / name for name in ("fast_exp.h", "panel_fma.h", "online_softmax.h"))
ABI = 6  # pdserve_paged_decode_abi() of the sources this module (cpu_layer_ops.py, cpu_linear.py) calls
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99")
PANEL = 32  # csrc/panel_fma.h's NB: the prefill kernel reads V rows NB floats at a time
use_prefill_kernel = True  # False: prefill spans take torch's SDPA (scripts/bench_cpu_prefill.py compares)
_i64, _f32p, _i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model name and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def library_path(cache_dir: Path | None = None) -> Path:
    """Where the built kernel for this source, these flags and this CPU lives."""
    root = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "kernels"
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join(CFLAGS).encode() + _cpu_signature().encode())
    return root / f"paged_decode-{key.hexdigest()[:16]}.so"


def build(cache_dir: Path | None = None, compiler: str | None = None) -> Path | None:
    """Compile the kernel if it is not built yet; its path, or None when no compiler could build it.
    Concurrent builders are safe: each writes a temporary file and renames it into place."""
    out = library_path(cache_dir)
    if out.exists():
        return out
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cc, *CFLAGS, *map(str, SOURCES), "-o", str(tmp_out), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(tmp_out, out)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out


def load(path: Path) -> ctypes.CDLL | None:
    """The kernel library at `path` with its argument types set, or None if it does not load or its ABI differs."""
    try:
        lib = ctypes.CDLL(str(path))
        if lib.pdserve_paged_decode_abi() != ABI:
            return None
    except (OSError, AttributeError):
        return None
    fn = lib.pdserve_paged_decode_f32
    fn.argtypes = [_f32p, _f32p, _f32p, _i64, _i64, _i64, _i64p, _i64, _i64p]
    fn.argtypes += [_i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _f32p]
    fn.restype = None
    pf = lib.pdserve_paged_prefill_f32
    pf.argtypes = [_f32p, _i64, _f32p, _f32p, _i64, _i64, _i64, _i64p, _i64, _i64, _i64, _i64, _i64, _i64, _i64]
    pf.argtypes += [ctypes.c_float, _f32p]
    pf.restype = None
    norm = lib.pdserve_add_rmsnorm_f32  # the layer's small ops: csrc/layer_ops.c, called by cpu_layer_ops.py
    norm.argtypes = [_f32p, _f32p, _f32p, ctypes.c_float, _i64, _i64, _f32p]
    norm.restype = None
    rope = lib.pdserve_qkv_rope_store_f32
    rope.argtypes = [_f32p, _i64, _i64, _f32p, _f32p, _f32p, _f32p, ctypes.c_float, _f32p, _f32p, _i64, _i64, _i64]
    rope.argtypes += [_i64, _i64p, _i64, _i64, _i64]
    rope.restype = None
    act = lib.pdserve_act_and_mul_f32
    act.argtypes = [_f32p, _i64, _i64, ctypes.c_int32, _f32p]
    act.restype = None
    gemm = lib.pdserve_linear_panels_f32  # csrc/small_gemm.c, called by cpu_linear.py
    gemm.argtypes = [_f32p, _i64, _i64, _i64, _f32p, _i64, _f32p, _f32p, _i64]
    gemm.restype = None
    lib.pdserve_linear_panel_width.restype = _i64
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    try:
        path = build()
    except OSError:  # the source is missing (an install without package data): the portable path serves
        return None
    return None if path is None else load(path)


def decode_kernel() -> ctypes.CDLL | None:
    """The built kernel library, built on first call (None when it cannot be built: use the portable path)."""
    return _library()


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can read these tensors: float32 on the CPU, head_dim contiguous, K and V alike."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
    )


def prefill_fits(q: torch.Tensor) -> bool:
    """Whether the prefill kernel serves these queries (after `fits`): its panels are PANEL floats of head_dim."""
    return use_prefill_kernel and q.shape[-1] % PANEL == 0


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, num_heads, head_dim] float32: one query token per decode sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided layer view)
    v_cache: torch.Tensor,
    d: DecodeBatch,
    scale: float,
    window: int | None,  # keys a query sees, itself included; None = whole context
) -> torch.Tensor:
    """Attention of each decode row over its cached context: [B, num_heads, head_dim] (see the C source)."""
    q = q.contiguous()
    tables, lens = d.block_tables.contiguous(), d.context_lens.contiguous()
    bsz, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    block_stride, row_stride, head_stride, _ = k_cache.stride()
    lib.pdserve_paged_decode_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        row_stride,
        head_stride,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        bsz,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window or 0,
        scale,
        out.data_ptr(),
    )
    return out


def paged_prefill(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_query, num_heads, head_dim] float32: one span's new tokens (a row-strided view too)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided layer view)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(context_len / block_size)] int64
    context_len: int,  # tokens with KV after this step, the span's own included (already written)
    scale: float,
    window: int | None,  # keys a query sees, itself included; None = whole context
) -> torch.Tensor:
    """Causal attention of one prefill span over its cached context, read in place: [num_query, num_heads,
    head_dim] (see the C source). q is read in place when only its token stride is not the contiguous one, as in
    a view of the qkv projection's output."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    table = block_table.contiguous()
    num_query, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    block_stride, row_stride, head_stride, _ = k_cache.stride()
    lib.pdserve_paged_prefill_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        row_stride,
        head_stride,
        table.data_ptr(),
        num_query,
        context_len,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window or 0,
        scale,
        out.data_ptr(),
    )
    return out


if __name__ == "__main__":  # `make install` builds ahead of time; a failure is not an error (portable path)
    built = build()
    print(f"pdserve CPU decode kernel: {built or 'not built (no C compiler): the portable path serves'}")
    sys.exit(0)
