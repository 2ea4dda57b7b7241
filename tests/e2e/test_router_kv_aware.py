"""`pdserve proxy --routing kv-aware` in front of real instances of the tiny Llama (issue 29 items 2 and 3), one
deployment for every case: 1 P + 2 D in pull mode and 1 P + 2 D in push mode (instances serve one transfer mode
only), each with a deployment secret (without which D keeps received KV out of its prefix cache) behind a
kv-aware router of that mode with --colocate-below 24 (16-token blocks), and a colocated kv-aware router over one
of the pull D and a stub backend whose /kv_events is garbage.

- in either mode, a conversation's turns stay on the D that served the first turn; a turn whose uncached suffix
  there is below the threshold runs whole on that D (P never sees it: P's counters stand still; D reports the
  prefix as cached tokens); a longer turn goes through P to that D, which receives only the KV it does not
  cache; every answer equals the other D's colocated answer, and every block is free afterwards;
- a stub answering garbage on /kv_events closes that stream only: the router keeps routing, says so in
  /metrics;
- a D killed mid-deployment: its stream is lost (logged once, /metrics 0) and routing goes on with the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from helpers import Launcher, Proc, post, scrape_metrics, wait_idle
from stub_backend import StubBackend

from pdserve.router.tokenizer import RouterTokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 8}
COLOCATE_BELOW = 24
TURN_0 = [5 + (7 * i) % 250 for i in range(80)]  # 5 full blocks of 16
DEADLINE_S = 60.0


class PD:
    """1 P + 2 D of one transfer mode behind a kv-aware router of that mode."""

    def __init__(self, p: Proc, ds: list[Proc], router: Proc) -> None:
        self.p, self.ds, self.router = p, ds, router


class Deployment:
    def __init__(self, modes: dict[str, PD], stub: StubBackend, colocated: Proc) -> None:
        self.modes, self.stub, self.colocated = modes, stub, colocated
        self.pull = modes["pull"]


@pytest.fixture(scope="module")
def dep(launcher: Launcher, tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    secret = tmp_path_factory.mktemp("secret") / "kv_auth_secret"  # D caches received KV only with a secret
    secret.write_text("kv-aware-e2e-secret-0123456789\n")
    secret.chmod(0o600)
    auth = ["--kv-auth-secret-file", str(secret)]
    instances = {}
    for mode in ("pull", "push"):
        common = ["--kv-transfer", mode, "--num-gpu-blocks", "64", *auth]
        p = launcher.serve(tiny_llama, "--kv-role", "prefill", *common, name=f"P-{mode}")
        ds = [launcher.serve(tiny_llama, "--kv-role", "decode", *common, name=f"D{i}-{mode}") for i in range(2)]
        instances[mode] = (p, ds)
    launcher.wait_ready()
    completion = {"choices": [{"index": 0, "text": "stub", "finish_reason": "length"}], "object": "text_completion"}
    with StubBackend(info=lambda: {}, answer=lambda path: (200, completion)) as stub:
        kv = ["--routing", "kv-aware", "--health-interval-s", "0.5"]
        below = ["--colocate-below", str(COLOCATE_BELOW)]
        modes = {
            mode: PD(p, ds, launcher.proxy(mode, [p], ds, *kv, *auth, *below, name=f"router-{mode}"))
            for mode, (p, ds) in instances.items()
        }
        d0 = instances["pull"][1][0]
        colocated = launcher.start(
            "router-colocated",
            ["proxy", "--mode", "colocated", "--port", "0", "--instance", d0.url, stub.url, *kv],
            0,
        )
        launcher.wait_ready()
        yield Deployment(modes, stub, colocated)


def wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:.0f} s: {what}"
        time.sleep(0.1)


def router_metric(router: Proc, name: str) -> float:
    return scrape_metrics(router.url).get(name, -1.0)


def log_line(proc: Proc, request_id: str) -> str:
    lines = [ln for ln in proc.log_text().splitlines() if f"request {request_id} " in ln]
    assert lines, f"no log line for {request_id}"
    return lines[-1]


def ask(url: str, prompt: list[int], request_id: str) -> dict[str, Any]:
    resp = post(url, "/v1/completions", {"prompt": prompt, **GREEDY}, {"X-Request-Id": request_id})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def seen_by(proc: Proc, request_id: str) -> bool:
    timeline = httpx.get(proc.url + "/timeline", timeout=10, trust_env=False).json()
    return any(t.get("client_request_id") == request_id for t in timeline)


def keys_of(router: Proc, d: Proc) -> float:
    return router_metric(router, f'pdserve_router_kv_index_keys{{instance="{d.url}"}}')


def received(d: Proc) -> float:
    return scrape_metrics(d.url)["pdserve_kv_received_bytes_total"]


def p_counts(p: Proc) -> tuple[float, float, float]:
    """What P did: requests started, prompt tokens admitted, KV bytes sent."""
    m = scrape_metrics(p.url)
    return m["pdserve_requests_started_total"], m["pdserve_prompt_tokens_total"], m["pdserve_kv_sent_bytes_total"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_conversation_stays_where_its_prefix_is(dep: Deployment, mode: str) -> None:
    pd = dep.modes[mode]
    prompts, answers = [TURN_0], []
    before = {d.url: received(d) for d in pd.ds}
    first = ask(pd.router.url, TURN_0, "conv-0")
    assert "route=split" in log_line(pd.router, "conv-0")
    home = next(d for d in pd.ds if seen_by(d, "conv-0"))  # the D that served turn 0
    turn_0_bytes = received(home) - before[home.url]
    answers.append(first["choices"][0]["token_ids"])
    wait_for("the router learned turn 0's blocks on its D", lambda: keys_of(pd.router, home) >= 5)
    # turn 1: 80 cached + 8 answer + 10 new tokens: 18 uncached at home, below 24: whole on home
    prompts.append(TURN_0 + answers[0] + [100 + i for i in range(10)])
    p_before = p_counts(pd.p)
    second = ask(pd.router.url, prompts[1], "conv-1")
    line = log_line(pd.router, "conv-1")
    assert "route=whole" in line and f"decode={home.url}" in line, line
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80  # home's prefix cache served it
    assert seen_by(home, "conv-1") and not seen_by(pd.p, "conv-1")  # P never saw it
    assert p_counts(pd.p) == p_before  # no request, no prompt token, no KV byte on P
    answers.append(second["choices"][0]["token_ids"])
    wait_for("the router learned turn 1's blocks", lambda: keys_of(pd.router, home) >= 6)
    # turn 2: 40 new tokens, above the threshold: through P, and to home again (its cache)
    prompts.append(prompts[1] + answers[1] + [150 + i for i in range(40)])
    before_turn_2 = received(home)
    third = ask(pd.router.url, prompts[2], "conv-2")
    line = log_line(pd.router, "conv-2")
    assert "route=split" in line and f"decode={home.url}" in line, line
    # 146 tokens, 96 of them cached at home: P's KV for those is not sent (~50 tokens moved, vs turn 0's ~80)
    assert 0 < received(home) - before_turn_2 < turn_0_bytes
    answers.append(third["choices"][0]["token_ids"])
    other = next(d for d in pd.ds if d is not home)
    for i, prompt in enumerate(prompts):  # colocated, on the D that served none of them
        assert ask(other.url, prompt, f"ref-{i}")["choices"][0]["token_ids"] == answers[i], i
    assert router_metric(pd.router, 'pdserve_router_kv_hit_blocks_total{role="decode"}') >= 10
    for proc in [pd.p, *pd.ds]:
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


def test_chat_turns_are_hashed_with_the_router_tokenizer(dep: Deployment, tiny_llama: Any) -> None:
    """The router tokenizes chat as the server does (router/tokenizer.py), so a chat's next turn is predicted to
    hit the D that served the first and runs whole there."""
    tok = RouterTokenizer(tiny_llama)
    system = "You answer briefly. "
    while len(tok.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": "Q"}])) % 16:
        system += "x"  # turn 1's prompt is whole blocks, so all of it can be cached
    first = [{"role": "system", "content": system * 3}, {"role": "user", "content": "Q"}]
    while len(tok.chat_ids(first)) % 16:
        first[0]["content"] += "y"
    second = [*first, {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}]
    num_first, num_second = len(tok.chat_ids(first)), len(tok.chat_ids(second))
    assert num_first >= 48 and num_second - num_first < COLOCATE_BELOW <= num_first  # the case's premise

    def chat(messages: list[dict[str, str]], request_id: str) -> dict[str, Any]:
        body = {"messages": messages, **GREEDY}
        resp = post(dep.pull.router.url, "/v1/chat/completions", body, {"X-Request-Id": request_id})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    before = {d.url: keys_of(dep.pull.router, d) for d in dep.pull.ds}
    chat(first, "chat-0")
    assert "route=split" in log_line(dep.pull.router, "chat-0")
    home = next(d for d in dep.pull.ds if seen_by(d, "chat-0"))
    learned = before[home.url] + num_first // 16
    wait_for("the router learned chat-0's blocks", lambda: keys_of(dep.pull.router, home) >= learned)
    answer = chat(second, "chat-1")
    line = log_line(dep.pull.router, "chat-1")
    assert "route=whole" in line and f"decode={home.url}" in line, line
    assert answer["usage"]["prompt_tokens"] == num_second  # the router's count is the server's
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == num_first


def test_a_garbage_event_stream_closes_that_stream_only(dep: Deployment) -> None:
    stub_up = f'pdserve_router_kv_stream_up{{instance="{dep.stub.url}"}}'
    fails = f'pdserve_router_kv_stream_failures_total{{instance="{dep.stub.url}"}}'
    wait_for("the stub's stream failed twice", lambda: router_metric(dep.colocated, fails) >= 2)
    assert router_metric(dep.colocated, stub_up) == 0
    assert router_metric(dep.colocated, f'pdserve_router_kv_stream_up{{instance="{dep.pull.ds[0].url}"}}') == 1
    for i in range(4):  # the router still routes (to the stub's fake answers and to D0)
        ask(dep.colocated.url, TURN_0[: 20 + i], f"garbage-{i}")
    assert dep.colocated.popen.poll() is None
    assert dep.colocated.log_text().count(f"kv events of {dep.stub.url} lost") == 1  # said once


def test_a_killed_decode_instance_leaves_routing_to_the_other(dep: Deployment) -> None:
    dead, alive = dep.pull.ds[1], dep.pull.ds[0]
    dead.stop()
    up = f'pdserve_router_kv_stream_up{{instance="{dead.url}"}}'
    fails = f'pdserve_router_kv_stream_failures_total{{instance="{dead.url}"}}'
    wait_for("the dead D's stream is lost", lambda: router_metric(dep.pull.router, up) == 0)
    wait_for("a retry failed too", lambda: router_metric(dep.pull.router, fails) >= 2)
    for i in range(3):
        ask(dep.pull.router.url, [9 + i] * 40, f"after-kill-{i}")
        assert f"decode={alive.url}" in log_line(dep.pull.router, f"after-kill-{i}")
    assert dep.pull.router.log_text().count(f"kv events of {dead.url} lost") == 1
    for proc in (dep.pull.p, alive):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name
