"""The multiturn and shared-prefix datasets: seeded, prefixes exactly as promised, lengths as configured; their
flags; and the closed loop through the real client and runner against a fake streaming server."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.bench import cli_bench, cli_sweep, workload
from pdserve.bench.client import ClientConfig, RequestOutput
from pdserve.bench.dataset import random_requests, shared_prefix_requests
from pdserve.bench.metrics import calculate_metrics
from pdserve.bench.multiturn import Conversation, MultiTurnConfig, conversations, ttft_turn_medians_ms
from pdserve.bench.runner import LoadConfig, run_load
from pdserve.bench.sweep_config import bench_argv
from pdserve.bench.tokenizer import Vocab, load_vocab

SYSTEM, TURN, OUTPUT = 24, 10, 5


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Vocab:
    path = tmp_path_factory.mktemp("vocab")
    (path / "config.json").write_text('{"vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2}')
    return load_vocab(str(path))


def _cfg(**changes: object) -> MultiTurnConfig:
    values: dict = dict(
        num_users=6, num_turns=4, system_prompt_len=SYSTEM, turn_len=TURN, output_len=OUTPUT, think_time_s=0.0
    )
    return MultiTurnConfig(**{**values, **changes})


def _answer(request_id: str, length: int) -> list[int]:
    """A made-up answer of `length` ids, different per request."""
    return [(zlib.crc32(request_id.encode()) + i) % 250 + 3 for i in range(length)]


def _all_turns(conv: Conversation) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of every turn, answering each turn with `_answer`."""
    turns = []
    request = conv.first_request()
    while True:
        assert isinstance(request.prompt, list)
        answer = _answer(request.request_id, request.expected_output_len)
        turns.append((request.prompt, answer))
        if request.turn + 1 == conv.num_turns:
            return turns
        request = conv.next_request(request, answer)


def test_conversations_are_seeded(vocab: Vocab) -> None:
    a = conversations(vocab, _cfg(range_ratio=0.5), seed=3, id_prefix="x")
    assert a == conversations(vocab, _cfg(range_ratio=0.5), seed=3, id_prefix="x")
    assert a != conversations(vocab, _cfg(range_ratio=0.5), seed=4, id_prefix="x")
    assert [c.user for c in a] == list(range(6)) and all(c.num_turns == 4 for c in a)


def test_every_turn_starts_with_the_previous_prompt_and_answer(vocab: Vocab) -> None:
    convs = conversations(vocab, _cfg(), seed=1, id_prefix="mt")
    system = convs[0].system_ids
    assert len(system) == SYSTEM
    for conv in convs:
        turns = _all_turns(conv)
        assert turns[0][0][:SYSTEM] == system and len(turns[0][0]) == SYSTEM + TURN
        for (prompt, answer), (next_prompt, _) in zip(turns, turns[1:], strict=False):
            assert next_prompt[: len(prompt) + len(answer)] == prompt + answer
            assert len(next_prompt) == len(prompt) + len(answer) + TURN
        assert len(turns[-1][0]) == SYSTEM + 4 * TURN + 3 * OUTPUT == _cfg().max_prompt_len
        request = conv.first_request()
        assert (request.request_id, request.user, request.turn, request.expected_output_len) == (
            f"mt-{conv.user}-0",
            conv.user,
            0,
            OUTPUT,
        )
    # users share exactly the system prompt: their first own tokens differ
    assert len({conv.first_request().prompt[SYSTEM] for conv in convs}) == len(convs)  # type: ignore[index]


def test_lengths_spread_by_range_ratio_and_no_system_prompt(vocab: Vocab) -> None:
    cfg = _cfg(num_users=40, system_prompt_len=0, turn_len=20, output_len=10, range_ratio=0.5)
    convs = conversations(vocab, cfg, seed=0)
    lens = [len(ids) for c in convs for ids in c.turn_ids]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 5
    assert all(5 <= n <= 15 for c in convs for n in c.output_lens)
    assert all(c.system_ids == [] and c.first_request().prompt == c.turn_ids[0] for c in convs)
    assert cfg.max_prompt_len == 4 * 30 + 3 * 15


def test_next_request_refuses_what_is_not_its_next_turn(vocab: Vocab) -> None:
    a, b = conversations(vocab, _cfg(num_users=2, num_turns=2), seed=0)
    first = a.first_request()
    with pytest.raises(ValueError, match="not a token-id turn of user 1"):
        b.next_request(first, [5])
    with pytest.raises(ValueError, match="no turn 2"):
        a.next_request(a.next_request(first, [5]), [6])


@pytest.mark.parametrize(
    "change",
    [{"num_users": 0}, {"num_turns": 0}, {"turn_len": 0}, {"system_prompt_len": -1}, {"think_time_s": -0.1}],
)
def test_config_refuses_out_of_range(change: dict) -> None:
    with pytest.raises(ValueError):
        _cfg(**change)


def test_shared_prefix_prompts_share_exactly_the_document(vocab: Vocab) -> None:
    reqs = shared_prefix_requests(vocab, num_prompts=30, prefix_len=40, question_len=12, output_len=3, seed=5)
    assert reqs == shared_prefix_requests(vocab, 30, 40, 12, 3, seed=5)
    assert reqs != shared_prefix_requests(vocab, 30, 40, 12, 3, seed=6)
    document = reqs[0].prompt[:40]
    for r in reqs:
        assert len(r.prompt) == r.prompt_len == 52 and r.prompt[:40] == document and r.expected_output_len == 3
    assert len({r.prompt[40] for r in reqs}) == 30  # questions differ from their first token on
    assert [(r.user, r.turn) for r in reqs] == [(i, 0) for i in range(30)]
    assert random_requests(vocab, 3, 8, 2)[2].user == 2


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_defaults_ranges_and_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--dataset", "multiturn", "--num-users", "3", "--num-turns", "5", "--think-time", "0.5"])
    assert (workload.resolve_num_prompts(args), workload.input_len(args)) == (15, 256)
    assert _parse(workload.bench_argv(args)).__dict__ == args.__dict__  # what the sweep passes on
    args.num_prompts = 14
    with pytest.raises(ValueError, match="3 x 5 = 15 requests, not --num-prompts 14"):
        workload.resolve_num_prompts(args)
    shared = _parse(["--dataset-name", "shared-prefix", "--shared-prefix-len", "64"])
    assert (workload.resolve_num_prompts(shared), workload.input_len(shared)) == (100, 128)
    assert _parse(workload.bench_argv(shared)).shared_prefix_len == 64
    assert workload.bench_argv(_parse([])) == [] and workload.input_len(_parse([])) == 1024
    for bad in (["--num-turns", "0"], ["--think-time", "-1"], ["--system-prompt-len", "-2"], ["--dataset", "x"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    assert "must be" in capsys.readouterr().err


def test_workload_refuses_what_multiturn_cannot_send(vocab: Vocab) -> None:
    args = _parse(["--dataset", "multiturn", "--num-users", "2", "--num-turns", "2", "--input-len", "8"])
    args.num_prompts = workload.resolve_num_prompts(args)
    work = workload.build(args, vocab, as_text=False, id_prefix="w")
    assert work.num_requests == 4 and work.warmup_input_len == 512 + 8
    assert work.params["turn_len"] == 8 and work.params["num_users"] == 2 and work.params["seed"] == 0
    with pytest.raises(ValueError, match="/v1/completions"):
        workload.build(args, vocab, as_text=True, id_prefix="w")
    args.return_token_ids = False
    with pytest.raises(ValueError, match="return-token-ids"):
        workload.build(args, vocab, as_text=False, id_prefix="w")


def test_turn_medians() -> None:
    assert ttft_turn_medians_ms([0, 1, 0, 1, 2], [0.1, 0.2, 0.3, None, None]) == pytest.approx([200.0, 200.0, None])
    outs = [RequestOutput("a", True, 4, 2, 0.1, [0.1], 0.2, user=1, turn=2)]
    r = calculate_metrics(outs, duration=1.0)
    assert (r["users"], r["turns"]) == ([1], [2])


def _fake_server(arrived: dict[str, float], done: dict[str, float], fail: str) -> web.Application:
    """Streams max_tokens one-token chunks with their ids, 10 ms apart; records when each request id arrived
    and when its answer was complete (unix times); answers 500 to the request id `fail`."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers["X-Request-Id"]
        arrived[rid] = time.time()
        if rid == fail:
            return web.Response(status=500, text="made to fail")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in _answer(rid, body["max_tokens"]):
            await asyncio.sleep(0.01)
            chunk = {"choices": [{"text": "x", "token_ids": [token], "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        done[rid] = time.time()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_runner_plays_each_conversation_in_order(vocab: Vocab) -> None:
    """Turn k+1 reaches the server only after turn k's answer and the think time; a failed turn ends its
    conversation (the rest reported failed, never sent); outputs come back in send order."""
    think = 0.05
    convs = conversations(vocab, _cfg(num_users=4, num_turns=3, think_time_s=think), seed=2, id_prefix="c")
    arrived: dict[str, float] = {}
    done: dict[str, float] = {}

    async def main() -> list[RequestOutput]:
        runner = web.AppRunner(_fake_server(arrived, done, fail="c-2-1"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = ClientConfig(api_url=f"http://127.0.0.1:{port}/v1/completions", model="m", is_chat=False)
        try:
            outputs, _ = await run_load(client, convs, LoadConfig(request_rate=40.0, show_progress=False))
        finally:
            await runner.cleanup()
        return outputs

    outputs = asyncio.run(main())
    assert len(outputs) == 12 and [o.start_time for o in outputs] == sorted(o.start_time for o in outputs)
    by_id = {o.request_id: o for o in outputs}
    assert set(arrived) == {f"c-{u}-{t}" for u in range(4) for t in range(3)} - {"c-2-2"}  # c-2-2 never sent
    assert not by_id["c-2-1"].success and not by_id["c-2-2"].success and "not sent: turn 1" in by_id["c-2-2"].error
    for u in (0, 1, 3):
        for t in (1, 2):
            before, out = by_id[f"c-{u}-{t - 1}"], by_id[f"c-{u}-{t}"]
            assert out.success and (out.user, out.turn) == (u, t)
            assert out.start_time >= before.start_time + before.latency + think
            assert arrived[out.request_id] >= done[before.request_id] + think - 0.002  # server's clock
            assert out.prompt_len == before.prompt_len + OUTPUT + TURN
            assert before.output_ids == _answer(before.request_id, OUTPUT)


def test_sweep_passes_the_dataset_to_every_point(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli_sweep.add_arguments(parser)
    argv = ["m", "--results-dir", str(tmp_path), "--dataset", "multiturn", "--num-users", "3", "--num-turns", "2"]
    cfg = cli_sweep.config_from_args(parser.parse_args([*argv, "--think-time", "0.25", "--input-lens", "16"]))
    assert cfg.num_prompts == 6
    point = _parse(bench_argv(cfg, "http://x", cfg.points()[0], seed=5, prefix="p"))
    assert (point.dataset, point.num_users, point.num_turns, point.think_time, point.input_len) == (
        "multiturn",
        3,
        2,
        0.25,
        16,
    )
    assert workload.resolve_num_prompts(point) == 6
    with pytest.raises(ValueError, match="leave --num-prompts out"):
        cli_sweep.config_from_args(parser.parse_args([*argv, "--num-prompts", "20"]))
    random = cli_sweep.config_from_args(parser.parse_args(["m", "--results-dir", str(tmp_path)]))
    assert (random.num_prompts, random.dataset_args) == (20, ())
