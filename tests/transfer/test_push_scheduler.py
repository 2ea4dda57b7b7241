"""Push's scheduler half (pure Python, no NIXL): P announces at arrival the transfers it will produce, and
ends each with exactly one SendTask (finished) or one abandoned entry (aborted, failed)."""

from pdserve.config import TransferConfig
from pdserve.kv.params import Mode, PullSource, PushAnswer, PushSource, Refusal, RemoteDecode
from pdserve.transfer.scheduler.push import PushScheduler


def make() -> PushScheduler:
    return PushScheduler(TransferConfig(role="prefill", mode="push"), 4, "127.0.0.1", 5600)


def p_params(tid: str) -> RemoteDecode:
    return RemoteDecode(Mode.PUSH, tid)


def test_arrivals_are_expected_and_end_in_one_send_or_abandon():
    s = make()
    assert not s.needs_remote_kv("a", p_params("ta"))
    assert not s.needs_remote_kv("b", p_params("tb"))
    assert not s.needs_remote_kv("plain", None)  # not a disaggregated request: nothing to expect
    meta = s.build_step_meta()
    assert meta and meta.expected == [("a", "ta"), ("b", "tb")] and not meta.sends and not meta.abandoned
    keep = s.on_request_finished("a", [1, 2], 8, p_params("ta"))
    assert s.take_answer("a") == PushAnswer("ta", s.cfg.engine_id) and s.take_answer("a") is None
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


def test_decode_side_abort_before_allocation_leaves_nothing():
    s = make()
    assert s.needs_remote_kv("d", PushSource("t", "h", 1, None))
    s.on_request_aborted("d")  # Scheduler.finish(abort) of a request not parked yet
    assert not s.build_step_meta()


def test_params_of_the_other_mode_reach_the_transfer_thread():
    """A deployment mixing modes fails there, naming both modes (a 500; the router's 502 names the leg)."""
    s = make()
    source = PullSource("h", 1, None, "r", (0,), 3, None)
    assert s.needs_remote_kv("d", source)
    s.on_blocks_allocated("d", [0], 0, 4, source)
    assert s.build_step_meta().recvs[0].source == source


def test_a_prefill_without_transfer_id_is_answered_with_a_refusal():
    s = make()
    assert not s.needs_remote_kv("a", RemoteDecode(None, None))
    assert not s.on_request_finished("a", [1], 3, RemoteDecode(None, None))
    answer = s.take_answer("a")
    assert isinstance(answer, Refusal) and "transfer_id" in answer.error
    assert not s.build_step_meta()
