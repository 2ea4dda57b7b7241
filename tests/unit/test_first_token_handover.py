"""D's first output token handed over by the prefill with the KV of the whole prompt (issue 28 item 4), without
torch: which recvs take it (kv.params.hands_first_token), the range D asks for, the token appended as a sampled
one is (stop conditions), the fallbacks, the token's way across the P answer, the capability, the wire and the
tensor-parallel ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_scheduler import RecordingConnector

from pdserve.auth import AuthError
from pdserve.config import SchedulerConfig, TransferConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_landed import take_landed
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.capability import KVAuth
from pdserve.kv.decode import decode
from pdserve.kv.groups import KVGroups
from pdserve.kv.params import KVParamsError, PullSource, PushSource, RemoteDecode, encode, hands_first_token
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import RecvTask, SendTask, StepMeta, TransferResults, TransferStats
from pdserve.transfer.layout import group_ranges
from pdserve.transfer.ranks import RankMerger, decode_meta, decode_results, encode_meta, encode_results
from pdserve.transfer.scheduler.pull import PullScheduler
from pdserve.transfer.scheduler.push import PushScheduler
from pdserve.transfer.wire import decode as decode_wire
from pdserve.transfer.wire import encode as encode_wire
from pdserve.transfer.wire_notifs import PushDone

N = 10  # prompt tokens
EOS = 99
VOCAB = 128
PULL = PullSource("127.0.0.1", 5600, None, "p-1", (0, 1, 2), N, 4, first_token_id=42)
PUSH = PushSource("t-1", "127.0.0.1", 5600, None)


def make(block_size: int = 4) -> tuple[Scheduler, BlockPool, RecordingConnector]:
    pool = BlockPool(64, True)
    conn = RecordingConnector(block_size)
    return Scheduler(SchedulerConfig(8, 64), pool, block_size, 1024, conn), pool, conn


def parked(s: Scheduler, source: PullSource | PushSource, params: SamplingParams | None = None) -> Request:
    r = Request("d", list(range(N)), params or SamplingParams.greedy(4), (EOS,), source)
    s.add(r)
    assert s.schedule().chunks == [] and r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    return r


def landed(s: Scheduler, token: int | None, vocab: int = VOCAB) -> tuple[list[Request], TransferResults]:
    res = TransferResults(finished_recvs=["d"], first_tokens={} if token is None else {"d": token})
    return take_landed(s, res, vocab), res


def test_which_sources_hand_the_first_token_over() -> None:
    assert hands_first_token(PUSH, N) and hands_first_token(PULL, N)
    assert not hands_first_token(dataclasses.replace(PULL, first_token_id=None), N)  # a vLLM prefill's answer
    assert not hands_first_token(PULL, N + 1)  # P's KV ends elsewhere than this prompt: the token is not D's first


@pytest.mark.parametrize("source", [PULL, PUSH], ids=["pull", "push"])
def test_the_token_is_emitted_on_landing_and_decoding_continues_after_it(source: PullSource | PushSource) -> None:
    s, pool, conn = make()
    r = parked(s, source)
    assert conn.with_last_token  # the recv covers the whole prompt: D computes no prompt token
    took, res = landed(s, 42)
    assert took == [r] and r.output_token_ids == [42] and r.finish_reason is None and not res.failed_recvs
    assert r.num_computed_tokens == r.num_cached_tokens == N
    out = s.schedule()  # the first step computes the first output token's KV and samples the second
    assert [(c.start_pos, c.token_ids, c.sample, c.num_output_tokens) for c in out.chunks] == [(N, [42], True, 1)]
    s.update(out, {"d": 7})
    assert r.output_token_ids == [42, 7]


def test_without_a_token_d_computes_the_last_prompt_token_as_before() -> None:
    s, _, conn = make()
    r = parked(s, dataclasses.replace(PULL, first_token_id=None))
    assert not conn.with_last_token
    took, res = landed(s, None)
    assert took == [] and not res.failed_recvs and r.output_token_ids == []
    out = s.schedule()
    assert [(c.start_pos, c.token_ids, c.sample) for c in out.chunks] == [(N - 1, [N - 1], True)]


@pytest.mark.parametrize(
    ("params", "token", "reason"),
    [
        (SamplingParams.greedy(1), 42, "length"),  # max_tokens=1: done on landing, no step at all
        (SamplingParams.greedy(4), EOS, "stop"),
        (SamplingParams.greedy(4, stop_token_ids=(42,)), 42, "stop"),
        (SamplingParams.greedy(4, ignore_eos=True), EOS, None),
    ],
)
def test_stop_conditions_apply_to_the_handed_over_token(params: SamplingParams, token: int, reason: str | None) -> None:
    s, pool, _ = make()
    r = parked(s, PULL, params)
    took, _ = landed(s, token)
    assert took == [r] and r.finish_reason == reason
    if reason is not None:  # the engine finishes it (engine.py's _postprocess): every block is free again
        s.finish(r, reason)
        assert pool.num_free == pool.num_blocks and not s.has_work()


def test_an_impossible_token_fails_the_recv() -> None:
    s, pool, _ = make()
    r = parked(s, PUSH)
    took, res = landed(s, VOCAB)
    why = f"its first token {VOCAB} is outside the vocabulary"
    assert took == [] and res.failed_recvs == [("d", f"the prefill instance handed the KV over but {why}")]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV  # the engine fails it or recomputes it by policy
    assert s.on_kv_failed("d", recompute=True) is None
    out = s.schedule()  # recompute: the whole prompt here, D's own first token
    assert out.chunks[0].start_pos == 0 and len(out.chunks[0].token_ids) == N and r.output_token_ids == []


def test_kv_landed_without_its_token_computes_the_last_prompt_position() -> None:
    """A push recv that landed only by P's answer to its cancel (PushCancelAck(landed) carries no token): the KV
    of the whole prompt is there, so D computes its last prompt position, as for a prefill that hands none over."""
    s, pool, _ = make()
    r = parked(s, PUSH)
    took, res = landed(s, None)
    assert took == [] and not res.failed_recvs and r.output_token_ids == []
    out = s.schedule()
    assert [(c.start_pos, c.token_ids, c.sample) for c in out.chunks] == [(N - 1, [N - 1], True)]
    s.update(out, {"d": 7})
    out = s.schedule()  # and decoding goes on after D's own first token
    assert r.output_token_ids == [7] and [(c.start_pos, c.token_ids) for c in out.chunks] == [(N, [7])]
    s.finish(r, "abort")
    assert pool.num_free == pool.num_blocks and not s.has_work()


@pytest.mark.parametrize(("window", "can"), [(4, True), (3, False)])
def test_kv_without_its_token_in_a_windowed_group(window: int, can: bool) -> None:
    """A windowed group's table is cut at the window of position N (the first output token's): with window 3 and
    4-token blocks the last prompt position (N - 1 = 9) reads key 7, in block 1, which the cut left out (position
    10 reads from key 8, block 2): D cannot compute it and the recv fails (by policy); with window 4 it can."""
    pool = BlockPool(64, True)
    groups = KVGroups.of((None, window), 2)
    s = Scheduler(SchedulerConfig(8, 64), pool, 4, 1024, RecordingConnector(4), kv_groups=groups)
    r = parked(s, PUSH)
    landed_from = tuple(first for first, _ in group_ranges(groups.windows, 0, N, 4))  # as the transfer thread says
    res = TransferResults(finished_recvs=["d"], landed_from={"d": landed_from})
    assert take_landed(s, res, VOCAB) == []
    if can:
        assert not res.failed_recvs
        assert [(c.start_pos, c.token_ids) for c in s.schedule().chunks] == [(N - 1, [N - 1])]
    else:
        why = "no first token came, and a windowed layer group lacks a key the last prompt position reads"
        assert res.failed_recvs == [("d", f"the prefill instance handed the KV over but {why}")]
        assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV


def test_a_token_for_a_request_aborted_meanwhile_is_dropped_with_its_blocks() -> None:
    s, pool, _ = make()
    parked(s, PUSH)
    s.abort("d")
    took, res = landed(s, 42)
    assert took == [] and not res.failed_recvs and pool.num_free == pool.num_blocks


def test_p_answers_the_token_after_its_kv() -> None:
    cfg = TransferConfig(role="prefill", mode="pull")
    pull = PullScheduler(cfg, 4, "127.0.0.1", 5600)
    assert pull.on_request_finished("p", [0, 1, 2], N, RemoteDecode(None, None), token_ids=[*range(N), 42])
    answer = pull.take_answer("p")
    assert isinstance(answer, PullSource) and answer.first_token_id == 42 and answer.num_tokens == N
    assert pull.build_step_meta().sends[0].first_token_id == 42
    push = PushScheduler(dataclasses.replace(cfg, mode="push"), 4, "127.0.0.1", 5600)
    push.on_request_finished("q", [0, 1, 2], N, RemoteDecode(None, "t-1"), token_ids=list(range(N)))
    assert push.build_step_meta().sends[0].first_token_id is None  # nothing sampled: nothing handed over


def test_first_token_id_at_the_edge_and_in_the_capability() -> None:
    assert decode(json.loads(json.dumps(encode(PULL)))) == PULL
    for bad in (-1, 2**31, "42", 1.5, True):
        with pytest.raises(KVParamsError, match="first_token_id"):
            decode({**encode(PULL), "first_token_id": bad})
    prompt = list(range(N))
    issued = KVAuth(b"s" * 32).issue_pull(PULL, prompt, ttl_s=30)
    with pytest.raises(AuthError, match="forged or altered"):  # a client cannot choose D's first token
        KVAuth(b"s" * 32).check(dataclasses.replace(issued, first_token_id=43), prompt, {})
    KVAuth(b"s" * 32).check(issued, prompt, {})


def test_the_token_crosses_the_wire_and_the_ranks() -> None:
    done = PushDone("t-1", 0, 0, 1, 64, first_token_id=0)  # token 0 is a token, -1 none
    assert decode_wire(encode_wire(done)) == done
    meta = StepMeta(sends=[SendTask("p", (0, 1), 8, "t-1", (), 5), SendTask("q", (2,), 3, "t-2")])
    assert decode_meta(encode_meta(meta)) == meta
    res = TransferResults(finished_recvs=["a"], first_tokens={"a": 5})
    assert decode_results(encode_results(res, TransferStats()))[0] == res
    m = RankMerger(2)
    m.see(StepMeta(recvs=[RecvTask("a", (0,), 0, 8, PUSH)]))
    m.add(0, res)
    assert not m.take()[0].first_tokens  # rank 1's part has not landed yet
    m.add(1, TransferResults(finished_recvs=["a"], first_tokens={"a": 5}))
    out, _ = m.take()
    assert out.finished_recvs == ["a"] and out.first_tokens == {"a": 5}


@pytest.mark.parametrize("source", [PULL, PUSH], ids=["pull", "push"])
def test_a_pool_full_of_landed_requests_still_makes_progress(source: PullSource | PushSource) -> None:
    """Prompts ending on a block boundary (8 tokens, blocks of 4) park until the pool is full; once their KV
    landed with P's token, each one's first step must not need a block the pool does not have (the waiting
    branch never preempts: a request waiting for a block there waits for ever, the engine spinning)."""
    pool = BlockPool(6, True)
    s = Scheduler(SchedulerConfig(8, 64), pool, 4, 1024, RecordingConnector(4))
    if isinstance(source, PullSource):
        source = dataclasses.replace(source, block_ids=(0, 1), num_tokens=8)
    assert hands_first_token(source, 8)
    reqs = [Request(rid, [5 + i] * 8, SamplingParams.greedy(4), (EOS,), source) for i, rid in enumerate("ab")]
    for r in reqs:
        s.add(r)
    assert s.schedule().chunks == []
    assert [r.status for r in reqs] == [RequestStatus.WAITING_FOR_REMOTE_KV] * 2 and pool.num_free == 0
    res = TransferResults(finished_recvs=["a", "b"], first_tokens={"a": 42, "b": 43})
    take_landed(s, res, VOCAB)
    for _ in range(8):  # every request gets its first decode step and then finishes
        out = s.schedule()
        for r in s.update(out, {c.request_id: 7 for c in out.chunks if c.sample}):
            s.finish(r, "length")  # as the engine does with what update() says stopped
        if all(r.is_finished for r in reqs):
            break
    assert all(r.is_finished for r in reqs) and pool.num_free == 6
