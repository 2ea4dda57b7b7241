"""Push's scheduler half (pure Python, no NIXL): P announces at arrival the transfers it will produce, and
ends each with exactly one SendTask (finished) or one abandoned entry (aborted, failed)."""

import pytest

from pdserve.config import TransferConfig
from pdserve.transfer.push import PushScheduler


def make() -> PushScheduler:
    return PushScheduler(TransferConfig(role="prefill", mode="push"), 4, "127.0.0.1", 5600)


def p_params(tid: str) -> dict:
    return {"do_remote_decode": True, "transfer_id": tid, "transfer_mode": "push"}


def test_arrivals_are_expected_and_end_in_one_send_or_abandon():
    s = make()
    assert not s.needs_remote_kv("a", p_params("ta"))
    assert not s.needs_remote_kv("b", p_params("tb"))
    assert not s.needs_remote_kv("plain", None)  # not a disaggregated request: nothing to expect
    meta = s.build_step_meta()
    assert meta and meta.expected == [("a", "ta"), ("b", "tb")] and not meta.sends and not meta.abandoned
    keep, _ = s.on_request_finished("a", [1, 2], 8, p_params("ta"))
    s.on_request_aborted("b")
    s.on_request_aborted("b")  # once only
    s.on_request_aborted("plain")  # never expected: nothing to say
    meta = s.build_step_meta()
    assert keep and [t.request_id for t in meta.sends] == ["a"] and meta.abandoned == ["b"] and not meta.expected
    s.on_request_aborted("a")  # after its send: not abandoned
    assert not s.build_step_meta()


def test_arrival_and_abort_in_one_step():
    s = make()
    s.needs_remote_kv("a", p_params("ta"))
    s.on_request_aborted("a")
    meta = s.build_step_meta()
    assert meta.expected == [("a", "ta")] and meta.abandoned == ["a"]


def test_decode_side_abort_before_allocation_forgets_params():
    s = make()
    d_params = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 1}
    assert s.needs_remote_kv("d", d_params)
    s.on_request_aborted("d")  # Scheduler.finish(abort) of a request not parked yet
    with pytest.raises(RuntimeError, match="without needs_remote_kv"):
        s.on_blocks_allocated("d", [0], 0, 8)  # its params are gone
    assert not s.build_step_meta()
