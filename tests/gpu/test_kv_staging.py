"""kv_buffer_device "cpu" on CUDA: the KV caches live in VRAM, NIXL moves pinned host mirrors (staging.py).
One staged pull and one staged push between two processes on one GPU; D's cache must hold exactly P's bytes
for the transferred tokens and nothing else may change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.testing.transfer_pair import Instance, close_all, expected_kv, push_params, start_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cl():
    kw = dict(device="cuda", kv_buffer_device="cpu", num_blocks=64)
    insts = start_all(
        p_pull=Instance("prefill", "pull", block_size=16, **kw),
        d_pull=Instance("decode", "pull", block_size=16, **kw),
        p_push=Instance("prefill", "push", block_size=16, **kw),
        d_push=Instance("decode", "push", block_size=16, **kw),
    )
    yield insts
    close_all(insts)


def test_staged_pull_on_gpu(cl):
    p, d = cl["p_pull"], cl["d_pull"]
    p_kv = p.kv()
    p_blocks, d_blocks = [5, 6, 9, 2, 40, 41], [3, 4, 11, 12, 13, 60]
    keep, params = p.call("finish", "p-g1", p_blocks, 90, {"do_remote_decode": True})
    assert keep and d.call("needs", "g1", params)
    before = d.kv()
    d.call("alloc", "g1", d_blocks, 16, 90)
    kind, reason = d.wait_result("g1", timeout=30)
    assert kind == "finished", reason
    after = d.kv()
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 16, 73, staged=True))
    assert not np.array_equal(after, before)
    p.wait_send("p-g1")


def test_staged_push_on_gpu(cl):
    p, d = cl["p_push"], cl["d_push"]
    p_params, d_params = push_params(p, "tg1")
    p_kv, before = p.kv(), d.kv()
    p_blocks, d_blocks = [7, 8, 3, 1, 12, 50, 51, 52], [20, 21, 22, 5, 2, 4, 30, 31]
    assert d.call("needs", "d-tg1", d_params)
    d.call("alloc", "d-tg1", d_blocks, 0, 120)
    keep, _ = p.call("finish", "p-tg1", p_blocks, 120, p_params)
    assert keep
    kind, reason = d.wait_result("d-tg1", timeout=30)
    assert kind == "finished", reason
    after = d.kv()
    assert np.array_equal(after, expected_kv(before, p_kv, d_blocks, p_blocks, 0, 119, staged=True))
    p.wait_send("p-tg1", timeout=30)
