"""The CPU kernel library: build and bind the C sources in csrc/ (the one module that knows them).

csrc/paged_decode.c and paged_prefill.c (paged attention, called through attention.py), layer_ops.c (a decoder
layer's fused small ops, layer_ops.py) and small_gemm.c (the decode step's small-batch linears, linear.py) are
plain C with OpenMP, compiled together into one shared library with the system C compiler on first use (or ahead
of time by `make install`: `python -m pdserve.model.cpu.kernels`) into ~/.cache/pdserve/kernels/
(XDG_CACHE_HOME respected), one file per sources, flags and CPU, and loaded through ctypes with every entry
point's argument types set here: no torch headers, no ninja. It links the libgomp torch already loaded, so it
shares torch's OpenMP threads (torch.get_num_threads()).

When there is no compiler or the build fails, library() returns None and every caller takes its portable torch
path; both give the same tokens (tests/model/test_cpu_attention.py).
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

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("paged_decode.c", "paged_prefill.c", "layer_ops.c", "small_gemm.c"))
# included by the sources: part of the library's key
HEADERS = tuple(_CSRC / name for name in ("fast_exp.h", "panel_fma.h", "online_softmax.h"))
ABI = 6  # pdserve_paged_decode_abi() of the sources whose entry points load() types
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99")
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
    fn = lib.pdserve_paged_decode_f32  # csrc/paged_decode.c and paged_prefill.c, called by attention.py
    fn.argtypes = [_f32p, _f32p, _f32p, _i64, _i64, _i64, _i64p, _i64, _i64p]
    fn.argtypes += [_i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _f32p]
    fn.restype = None
    pf = lib.pdserve_paged_prefill_f32
    pf.argtypes = [_f32p, _i64, _f32p, _f32p, _i64, _i64, _i64, _i64p, _i64, _i64, _i64, _i64, _i64, _i64, _i64]
    pf.argtypes += [ctypes.c_float, _f32p]
    pf.restype = None
    norm = lib.pdserve_add_rmsnorm_f32  # the layer's small ops: csrc/layer_ops.c, called by layer_ops.py
    norm.argtypes = [_f32p, _f32p, _f32p, ctypes.c_float, _i64, _i64, _f32p]
    norm.restype = None
    rope = lib.pdserve_qkv_rope_store_f32
    rope.argtypes = [_f32p, _i64, _i64, _f32p, _f32p, _f32p, _f32p, ctypes.c_float, _f32p, _f32p, _i64, _i64, _i64]
    rope.argtypes += [_i64, _i64p, _i64, _i64, _i64]
    rope.restype = None
    act = lib.pdserve_act_and_mul_f32
    act.argtypes = [_f32p, _i64, _i64, ctypes.c_int32, _f32p]
    act.restype = None
    gemm = lib.pdserve_linear_panels_f32  # csrc/small_gemm.c, called by linear.py
    gemm.argtypes = [_f32p, _i64, _i64, _i64, _f32p, _i64, _f32p, _f32p, _i64]
    gemm.restype = None
    lib.pdserve_linear_panel_width.restype = _i64
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The kernel library, built on the first call (None when it cannot be built: the portable path serves)."""
    try:
        path = build()
    except OSError:  # the source is missing (an install without package data): the portable path serves
        return None
    return None if path is None else load(path)


if __name__ == "__main__":  # `make install` builds ahead of time; a failure is not an error (portable path)
    built = build()
    print(f"pdserve CPU kernel library: {built or 'not built (no C compiler): the portable path serves'}")
    sys.exit(0)
