"""Model tests run tiny models: one intra-op thread is faster than two (and than fighting other processes).

Set per module and restored after it, so tests outside tests/model keep the default thread count.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

from pdserve.model.cpu import kernels as cpu_kernels


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """The CPU kernel library (tests that take it are skipped where there is no C compiler)."""
    built = cpu_kernels.library()
    assert built is not None
    return built
