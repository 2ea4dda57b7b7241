"""Model tests run tiny models: one intra-op thread is faster than two (and than fighting other processes).

Set per module and restored after it, so tests outside tests/model keep the default thread count.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
