"""The CPU linears from packed weights (model/cpu/linear.py: MKL's packed GEMM, or column panels through
csrc/small_gemm.c) against F.linear, on odd shapes and both weight layouts; and the engine's greedy tokens with and
without them (tiny models; transformers' tokens are checked with them on in test_generate.py, where every CPU
decoder loads packed)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_generate import _llm, _prompts

from pdserve import SamplingParams
from pdserve.model.cpu.linear import (
    GEMM_LIBRARIES,
    MIN_ROWS,
    PANEL_MAX_ROWS,
    PackedLinears,
    cpu_vendor,
    gemm_library,
    mkl_packed_gemm,
    onednn_available,
    pack,
)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


def test_pack_layout() -> None:
    w = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # N 5, K 3, panels of 4 columns
    p = pack(w, 4)
    assert p.shape == (2, 3, 4)
    assert torch.equal(p[0], w[:4].t()) and torch.equal(p[1, :, :1], w[4:].t())
    assert not p[1, :, 1:].any()  # zero padding past N


@pytest.mark.parametrize("n, k", [(5, 7), (32, 64), (33, 64), (100, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(lib: ctypes.CDLL, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels = PackedLinears("panels", lib)
    packed = pack(w, panels.width)
    for m in (1, 2, 7, 8, 9, 16, 20):  # every row count the kernel takes, and past one pass of MR rows
        wide = torch.randn(m, k + 5, generator=gen)
        x = wide[:, 2 : 2 + k]  # row stride k + 5: the kernel reads through it
        y = torch.full((m, n), float("nan"))
        lib.pdserve_linear_panels_f32(
            x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, None if b is None else b.data_ptr(), y.data_ptr(), n
        )
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def _packer(backend: str, lib: ctypes.CDLL | None = None) -> PackedLinears:
    """A PackedLinears of the library `backend` names (one of GEMM_LIBRARIES), skipping where this torch build
    lacks it."""
    if backend.endswith("mkl") and mkl_packed_gemm() is None:
        pytest.skip("this torch build has no MKL packed GEMM")
    if backend.endswith("onednn") and not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    return PackedLinears(backend, lib, mkl_packed_gemm())


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
@pytest.mark.parametrize("n, k", [(5, 7), (33, 64), (100, 576)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(backend: str, n: int, k: int, layout: str, bias: bool) -> None:
    """The packed product (MKL's or oneDNN's) equals F.linear for weights stored either way (the engine stores
    linears column-major) and x read through a row stride, at every row count the engine gives it (decode rows to
    prefill chunks)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    if layout == "column-major":
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=gen) if bias else None
    linears = _packer(backend)
    linears.add("w", w)
    assert linears.backend == backend and linears.nbytes == n * k * 4
    b_before = None if b is None else b.clone()
    for m in (1, 2, 7, 16, 17, 64, 300):
        x = torch.randn(m, k + 3, generator=gen)[:, 1 : 1 + k]
        torch.testing.assert_close(linears.linear("w", x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)
        assert b is None or torch.equal(b, b_before)  # the output is never written into the bias


def test_gemm_library_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDSERVE_CPU_GEMM picks the library (falling back to one this build has); a name it does not know is an
    error that lists the names; unset, the choice is one of them."""
    assert gemm_library() in GEMM_LIBRARIES
    if cpu_vendor() not in ("GenuineIntel", "") and onednn_available():
        assert gemm_library() == "panels+onednn"  # the default off Intel CPUs
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "panels")
    assert gemm_library() == "panels"
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "onednn")
    assert gemm_library() == ("onednn" if onednn_available() else "mkl" if mkl_packed_gemm() else "panels")
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "panels+mkl")
    fallback = "panels+onednn" if onednn_available() else "panels"
    assert gemm_library() == ("panels+mkl" if mkl_packed_gemm() else fallback)
    monkeypatch.setenv("PDSERVE_CPU_GEMM", "blis")
    with pytest.raises(ValueError, match="onednn, mkl, panels, panels"):
        gemm_library()
    with pytest.raises(ValueError, match="unknown library"):
        PackedLinears("blis")


@pytest.mark.parametrize("backend", GEMM_LIBRARIES)
def test_dispatch_by_rows(lib: ctypes.CDLL, backend: str) -> None:
    """Rows up to PANEL_MAX_ROWS go through the panels where the library has them, rows from MIN_ROWS through MKL's
    or oneDNN's copy where it has one; other rows (or an unpacked key) are F.linear exactly."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen)
    linears = _packer(backend, lib)
    assert linears.backend == backend
    linears.add("w", w)
    panel_bytes = 2 * 24 * linears.width * 4 if backend.startswith("panels") else 0
    gemm_bytes = 40 * 24 * 4 if backend != "panels" else 0
    assert linears.nbytes == panel_bytes + gemm_bytes
    gemm = backend.rpartition("+")[2] if backend != "panels" else ""
    for m in (1, MIN_ROWS, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 64):
        x = torch.randn(m, 24, generator=gen)
        y = linears.linear("w", x, w)
        expected = "panels" if panel_bytes and m <= PANEL_MAX_ROWS else gemm if m >= MIN_ROWS else ""
        assert linears.route(m) == expected and linears.takes(m) == bool(expected)
        if expected:
            torch.testing.assert_close(y, F.linear(x, w))
        else:
            assert torch.equal(y, F.linear(x, w))
        assert torch.equal(linears.linear("other", x, w), F.linear(x, w))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_tokens_with_and_without_panels(
    family: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched greedy decode: the same tokens with the packed linears as with F.linear, and the packed copies were
    used (for the prefill's rows too where MKL packs)."""
    prompts = _prompts([3, 17, 30, 9, 12, 5], seed=11)
    params = SamplingParams.greedy(16)
    packed_llm = _llm(tiny_model_dirs[family], block_size=4)
    panels = packed_llm.engine.runner.decoder.cpu_linears
    assert panels is not None  # every float32 CPU decoder loads packed
    linear, calls = panels.linear, []

    def counting(key: str | torch.nn.Module, x: torch.Tensor, *args: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return linear(key, x, *args)

    monkeypatch.setattr(panels, "linear", counting)
    with_panels = [o.token_ids for o in packed_llm.generate(prompts, params)]
    assert any(panels.takes(m) and m <= 6 for m in calls)  # the batched decode steps
    assert panels.gemm == "" or any(panels.route(m) == panels.gemm for m in calls)  # the prefill
    plain_llm = _llm(tiny_model_dirs[family], block_size=4)
    plain_llm.engine.runner.decoder.cpu_linears = None
    assert with_panels == [o.token_ids for o in plain_llm.generate(prompts, params)]
