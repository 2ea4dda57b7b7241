"""The few-row CPU linears from packed panels (model/cpu_linear.py, csrc/small_gemm.c) against F.linear, on odd
shapes; and the engine's greedy tokens with and without them (tiny models; transformers' tokens are checked with
them on in test_generate.py, where every CPU decoder loads packed)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_generate import _llm, _prompts

from pdserve import SamplingParams
from pdserve.model.cpu_linear import MAX_ROWS, MIN_ROWS, PanelLinears, pack

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
    panels = PanelLinears(lib)
    packed = pack(w, panels.width)
    for m in (1, 2, 7, 8, 9, 16, 20):  # every row count the kernel takes, and past one pass of MR rows
        wide = torch.randn(m, k + 5, generator=gen)
        x = wide[:, 2 : 2 + k]  # row stride k + 5: the kernel reads through it
        y = torch.full((m, n), float("nan"))
        lib.pdserve_linear_panels_f32(
            x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, None if b is None else b.data_ptr(), y.data_ptr(), n
        )
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_dispatch_by_rows(lib: ctypes.CDLL) -> None:
    """Rows in [MIN_ROWS, MAX_ROWS] of a packed key go through the panels; others (or an unpacked key) are F.linear
    exactly."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen)
    panels = PanelLinears(lib)
    panels.add("w", w)
    assert panels.nbytes == 2 * 24 * panels.width * 4
    for m in (1, MIN_ROWS, MAX_ROWS, MAX_ROWS + 1, 64):
        x = torch.randn(m, 24, generator=gen)
        y = panels.linear("w", x, w)
        if MIN_ROWS <= m <= MAX_ROWS:
            torch.testing.assert_close(y, F.linear(x, w))
        else:
            assert torch.equal(y, F.linear(x, w))
        assert torch.equal(panels.linear("other", x, w), F.linear(x, w))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_tokens_with_and_without_panels(
    family: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched greedy decode: the same tokens with the packed linears as with F.linear, and the panels were used."""
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
    assert any(MIN_ROWS <= m <= MAX_ROWS for m in calls)
    plain_llm = _llm(tiny_model_dirs[family], block_size=4)
    plain_llm.engine.runner.decoder.cpu_linears = None
    assert with_panels == [o.token_ids for o in plain_llm.generate(prompts, params)]
