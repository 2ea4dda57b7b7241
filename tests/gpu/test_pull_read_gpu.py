"""Pull's READ between two processes on one GPU runs at GPU speed, and P's pin confirmation does not wait behind
other READs. On a GPU without active NVLink, UCX's default turns cuda_ipc GET off and a READ of VRAM fell back to
a software-emulated GET over TCP (~0.5 GB/s, every READ from one P in one ordered stream, P's PullReleaseAck behind
them; netdev.enable_cuda_ipc_get). Seen on one H200: 1.4 GB READs of 2.5-3 s and acks seconds late."""

from __future__ import annotations

import pytest
import torch

from pdserve.testing.transfer_pair import Instance, close_all, events, start_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DIMS = (8, 8, 128)  # layers, heads, head dim: float32 blocks of 16 tokens are 1 MiB each
NUM_BLOCKS, BLOCK = 600, 16


@pytest.fixture(scope="module")
def cl():
    kw = dict(device="cuda", num_blocks=NUM_BLOCKS, dims=DIMS, block_size=BLOCK)
    insts = start_all(p=Instance("prefill", "pull", **kw), d=Instance("decode", "pull", **kw))
    yield insts
    close_all(insts)


def test_pull_reads_vram_at_gpu_speed_and_acks_promptly(cl):
    p, d = cl["p"], cl["d"]
    n_blocks = 256  # 256 MiB per request; two requests in flight at once
    tokens = n_blocks * BLOCK
    rids = ["r1", "r2"]
    for i, rid in enumerate(rids):
        blocks = list(range(i * n_blocks, (i + 1) * n_blocks))
        keep, params = p.call("finish", f"p-{rid}", blocks, tokens, {"do_remote_decode": True})
        assert keep and d.call("needs", rid, params)
    for i, rid in enumerate(rids):  # both READs posted back to back
        d.call("alloc", rid, list(range(i * n_blocks, (i + 1) * n_blocks)), 0, tokens)
    for rid in rids:
        kind, reason = d.wait_result(rid, timeout=60)
        assert kind == "finished", reason
    for rid in rids:
        ev = events(d, rid)
        read_s = ev["transfer_done"] - ev["transfer_posted"]
        ack_s = ev["pull_ack.r0.p0"] - ev["transfer_done"]
        # cuda_ipc on one GPU: ~1-5 ms per 256 MiB; the emulated GET over TCP took ~0.5 s per 256 MiB
        assert read_s < 0.15, f"{rid}: READ of 256 MiB took {read_s:.3f} s (emulated GET over TCP?)"
        assert ack_s < 0.1, f"{rid}: PullReleaseAck {ack_s:.3f} s after the READ (queued behind other READs?)"
